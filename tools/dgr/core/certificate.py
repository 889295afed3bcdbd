"""The certificate `dgr certify` writes and workers hold: its model, its hash, and whether it is valid.

Pure data and hashing (pydantic + blake3 through dgr.core.hashing, no toolchain, no engine): the worker
(dgr.runtime.wire) imports it to decide which certificates it may advertise. A certificate is valid for a worker
only when its `identity` equals the worker's exactly (model, bundle id, lane, upstream commit, patch
series, engine library hash, and the worker binary's hash: dgr-worker's own bytes) and the contract file it was measured against still has the hash it
records: editing `certification/alpha.toml` invalidates every certificate made before the edit.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dgr.core.errors import DgrError
from dgr.core.hashing import bytes_blake3, file_blake3
from dgr.core.paths import REPO_ROOT

SCHEMA = "dgr.certificate/v1"

# The fields of an identity a worker compares with its own (the contract hash is checked against the file).
IDENTITY_FIELDS = ("model", "bundle_id", "lane", "upstream_commit", "patch_series", "engine_blake3")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Identity(_Frozen):
    """Exactly what was certified: a worker advertises a certificate only when these equal its own."""

    model: str                   # the recipe name (StageIdentity.model)
    bundle_id: str
    lane: str
    upstream_commit: str
    patch_series: str
    engine_blake3: str           # blake3 of the engine library file the stages ran on
    worker_blake3: str = ""      # blake3 of the worker binary (dgr-worker) that served them; "" in a certificate
                                 # made before certificates recorded it (never valid: re-certify)
    contract_blake3: str = ""    # blake3 of the contract file; "" in a worker's own identity (not compared)
    numerics: str = ""           # the engine's numerics the figures were measured with (docs/numerics.md); ""
                                 # in a certificate made before certificates named it (not compared then)


class Hardware(_Frozen):
    """The host the figures were measured on."""

    cpu_model: str
    cores: int
    memory_bytes: int
    os: str
    machine: str = ""
    gpu: str = ""


class Figure(_Frozen):
    """One row of the certificate (and of `dgr gate alpha`'s table)."""

    check: str                   # e.g. "parity greedy tokens", "decode ratio"
    figure: float | int | str    # the measured value
    threshold: str               # what it had to be, in words (">= 0.5", "== 0", "refused")
    passed: bool
    detail: str = ""


class ContractRef(_Frozen):
    path: str                    # as given to `dgr certify` (repository-relative when inside it)
    blake3: str
    name: str = ""


class StageRange(_Frozen):
    stage: int
    layer_begin: int
    layer_end: int


class Certificate(_Frozen):
    schema_: str = Field(SCHEMA, alias="schema")   # pydantic reserves `schema`; the JSON key is "schema"
    identity: Identity
    contract: ContractRef
    hardware: Hardware
    stages: tuple[StageRange, ...] = ()
    figures: tuple[Figure, ...] = ()
    passed: bool = False
    created_at: str = ""         # ISO 8601, UTC
    dgr_version: str = ""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    def canonical_json(self) -> bytes:
        """Sorted-key compact JSON: what `digest` hashes and what `save` writes (indented)."""
        return json.dumps(self.model_dump(mode="json", by_alias=True), sort_keys=True,
                          separators=(",", ":")).encode()

    @property
    def digest(self) -> str:
        """blake3 of the canonical JSON: names this certificate (descriptors list it)."""
        return bytes_blake3(self.canonical_json())

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(json.dumps(self.model_dump(mode="json", by_alias=True), sort_keys=True, indent=2) + "\n")
        tmp.replace(p)
        return p


class CertificateError(DgrError):
    """A file that is not a readable dgr certificate."""


def load_certificate(path: str | Path) -> Certificate:
    """Read a certificate JSON file (raises CertificateError on unreadable or malformed files)."""
    p = Path(path)
    try:
        raw = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CertificateError(f"{p}: not a readable certificate: {e}") from e
    if not isinstance(raw, dict) or raw.get("schema") != SCHEMA:
        got = raw.get("schema") if isinstance(raw, dict) else type(raw).__name__
        raise CertificateError(f"{p}: not a {SCHEMA} certificate (schema {got!r})")
    try:
        return Certificate.model_validate(raw)
    except ValidationError as e:
        raise CertificateError(f"{p}: malformed certificate: {e}") from e


def contract_hash(path: str | Path) -> str:
    """blake3 of a contract file's bytes (what a certificate records and `check` compares)."""
    return file_blake3(path, threads=False)


def resolve_contract(ref: str | Path, base: Path | None = None) -> Path:
    """A contract path as recorded: absolute, or relative to `base` (default: the repository root)."""
    p = Path(ref)
    if p.is_absolute():
        return p
    if base is None:
        base = REPO_ROOT
    return base / p


def check(cert: Certificate, identity: Identity, contract_path: str | Path | None = None) -> str | None:
    """None when `cert` is valid for a worker of `identity` and the contract file's current hash, else
    why not (one sentence for the worker's log). `contract_path` defaults to the path the certificate
    records (relative paths from the repository root)."""
    if cert.schema_ != SCHEMA:
        return f"certificate schema {cert.schema_!r} is not {SCHEMA!r}"
    mine, theirs = cert.identity, identity
    for f in IDENTITY_FIELDS:
        a, b = getattr(mine, f), getattr(theirs, f)
        if a != b:
            return f"certificate is for {f} {_short(a)}, this worker has {_short(b)}"
    if mine.numerics and mine.numerics != theirs.numerics:
        return f"certificate is for numerics {mine.numerics!r}, this worker computes {theirs.numerics!r}"
    if not mine.worker_blake3:
        return "certificate names no worker binary (it was made before certificates recorded worker_blake3): re-certify"
    if mine.worker_blake3 != theirs.worker_blake3:
        return (f"certificate is for worker {mine.worker_blake3[:12]}, this worker is {theirs.worker_blake3[:12]}: "
                "re-certify")
    if theirs.contract_blake3 and theirs.contract_blake3 != mine.contract_blake3:
        return (f"certificate was measured against contract {_short(mine.contract_blake3)}, this worker "
                f"expects {_short(theirs.contract_blake3)}")
    if mine.contract_blake3 != cert.contract.blake3:
        return "certificate is inconsistent: its identity and its contract name different contract hashes"
    path = Path(contract_path) if contract_path is not None else resolve_contract(cert.contract.path)
    try:
        now = contract_hash(path)
    except OSError as e:
        return f"contract file {path} cannot be read ({e.strerror or e}): the certificate cannot be checked"
    if now != mine.contract_blake3:
        return (f"contract file {path} changed since the certificate was made (blake3 {_short(now)}, "
                f"certified against {_short(mine.contract_blake3)}): recertify")
    if not cert.passed or not cert.figures or not all(f.passed for f in cert.figures):
        failed = [f.check for f in cert.figures if not f.passed]
        return f"certificate records a failed gate ({', '.join(failed) or 'no figures'})"
    return None


def _short(v: str) -> str:
    return v[:16] if len(v) > 24 and all(c in "0123456789abcdef" for c in v) else repr(v)
