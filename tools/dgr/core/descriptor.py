"""What a worker advertises to a mesh router: the descriptor, one frozen strict model, and its JSON schema.

A descriptor says what a stage worker is (its exact compatibility identity: two workers can serve one
route only if the identities agree), what it can take (capacity), how busy it is (load), what its seam
costs per token in every wire dtype, how healthy it has been, how it is secured, and which certificates
(`dgr certify`) it holds for exactly its identity. `Describe` carries it as JSON
(`StageDescription.descriptor_json`); `dgr worker describe HOST:PORT --json` prints it. Pure data: this
module imports pydantic and dgr.core.contract only, so the runtime (dgr.runtime.wire) may build it.

The committed schema is docs/schemas/descriptor.schema.json (`schema_json()`; `python -m dgr.core.descriptor`
rewrites it); tests/certify/test_descriptor.py fails when the model and the file drift apart.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, Field, field_validator, model_validator

from dgr.core.contract import STRICT, WIRE_DTYPES, BoundarySchema
from dgr.core.paths import REPO_ROOT

# Bump when a field changes meaning or goes away (adding a field is a new schema, same version).
SCHEMA_VERSION = 1
SCHEMA_PATH = Path("docs") / "schemas" / "descriptor.schema.json"   # relative to the checkout


class CompatIdentity(BaseModel):
    """What must be equal for stages to be combined and for a certificate to apply: the model, the exact
    bundle and stage, the patched upstream it runs on, the lane, the engine library's bytes and the worker
    binary's."""

    model_config = STRICT
    model: str = Field(description="source model name (the recipe's name)")
    bundle_id: str = Field(description="the bundle's content id: stages of one route share it")
    stage_index: int
    stage_count: int
    layer_begin: int = Field(description="half-open layer range [layer_begin, layer_end)")
    layer_end: int
    n_layer: int = Field(description="layers of the whole model")
    upstream_commit: str = Field(description="the llama.cpp commit of the pin ('' for the fake engine)")
    patch_series: str = Field(description="hash over the ordered patch stack ('' for the fake engine)")
    lane: str = Field(description="backend lane: cpu | cuda | rocm | vulkan | metal")
    arch: str = Field(description="the model's architecture (general.architecture)")
    engine: str = Field(description="'llama.cpp' or 'fake' (tests)")
    engine_blake3: str = Field(description="blake3 of the loaded engine library file (fake: of the fake "
                                           "engine's source)")
    worker_blake3: str = Field("", description="blake3 of the running dgr-worker executable (it hashes "
                                               "/proc/self/exe at start): a certificate names it; '' from the "
                                               "Python worker (tests only)")
    wire_dtype: str = Field(description="the dtype this worker's boundaries travel in")
    numerics: str = Field("", description="what decides the bits this stage computes: lane and instruction set, "
                                         "compiler, pin and patch series, kernel switches (the engine's "
                                         "dgr_engine_numerics, docs/numerics.md); a route is exact only when "
                                         "every stage's is equal")

    @model_validator(mode="after")
    def _check(self) -> "CompatIdentity":
        if not 0 <= self.stage_index < self.stage_count:
            raise ValueError(f"stage {self.stage_index} is not one of {self.stage_count} stages")
        if not 0 <= self.layer_begin < self.layer_end <= self.n_layer:
            raise ValueError(f"layer range [{self.layer_begin}, {self.layer_end}) is not a non-empty part of "
                             f"[0, {self.n_layer})")
        if self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"unknown wire dtype {self.wire_dtype!r}")
        return self


class Memory(BaseModel):
    """The engine's own report (ShardEngine.memory())."""

    model_config = STRICT
    weights_bytes: int
    kv_bytes: int = Field(description="KV and other per-layer state allocated (never shrinks)")
    compute_bytes: int
    device_weights_bytes: int = Field(description="of the weights, those on the lane's device")
    device: str = Field(description="the device's buffer type, e.g. 'Vulkan0'; '' on the CPU lane")


class StepTimes(BaseModel):
    """Measured engine time of the steps served so far (the last 1024): each step's compute is the engine
    call (batch) it ran in, queue is its wait for the engine thread."""

    model_config = STRICT
    steps: int = Field(description="steps measured (0: none yet, the figures are 0)")
    compute_ms_median: float
    compute_ms_p90: float
    queue_ms_median: float
    queue_ms_p90: float


class Capacity(BaseModel):
    model_config = STRICT
    max_sessions: int
    n_ctx: int = Field(description="positions one session may hold")
    max_queued_steps: int
    max_session_steps: int
    max_batch_tokens: int
    max_message_bytes: int
    session_ttl_s: float = Field(description="idle sessions are reaped after this long (0: never)")
    memory: Memory
    decode: StepTimes = Field(description="one-token steps")
    prefill: StepTimes = Field(description="steps of more than one token")


class Load(BaseModel):
    model_config = STRICT
    open_sessions: int
    queued_steps: int
    cached_positions: int = Field(description="positions held over all open sessions (KV in use)")


class Seam(BaseModel):
    """One seam of this stage: what crosses it per token."""

    model_config = STRICT
    layer: int = Field(description="the global layer index at the seam")
    n_streams: int
    n_embd: int
    token_ids: bool = Field(description="the token-id sideband travels with the boundary")
    wire_dtype: str = Field(description="the dtype this worker uses here")
    bytes_per_token: dict[str, int] = Field(description="boundary bytes per token in every wire dtype "
                                                        "(dgr.core.contract.WIRE_DTYPES) that fits the seam's width "
                                                        "(a block dtype needs a multiple of its block)")

    @classmethod
    def of(cls, schema: BoundarySchema, layer: int) -> "Seam":
        return cls(layer=layer, n_streams=schema.n_streams, n_embd=schema.n_embd, token_ids=schema.token_ids,
                   wire_dtype=schema.dtype, bytes_per_token={
                       name: d.nbytes(schema.values_per_token) for name, d in WIRE_DTYPES.items()
                       if schema.values_per_token % d.block == 0})


class SeamCost(BaseModel):
    model_config = STRICT
    seam_in: Seam | None = Field(description="what this stage takes (None on stage 0: token ids)")
    seam_out: Seam | None = Field(description="what this stage sends (None on the last stage: it samples)")


class Health(BaseModel):
    model_config = STRICT
    serving: bool = Field(description="False once the worker drains (SIGTERM)")
    uptime_s: float
    errors: dict[str, int] = Field(description="typed errors this worker answered, by dgr.v1.ErrorCode name")
    reaped_sessions: int
    overloaded: int = Field(description="requests answered OVERLOADED")
    restarts: int = Field(description="restarts by a supervisor (0 when not supervised)")


class Security(BaseModel):
    model_config = STRICT
    tls: bool
    mutual_tls: bool
    member: str = Field(description="the common name of the worker's TLS certificate; '' without TLS")


class HeldCertificate(BaseModel):
    """A certificate (`dgr certify`) whose identity equals this worker's exactly, under the current contract."""

    model_config = STRICT
    id: str = Field(description="the certificate's id")
    contract: str = Field(description="the contract it was certified under (its name)")
    contract_blake3: str
    lane: str
    issued_at: str = Field(description="when it was issued (ISO 8601)")
    summary: str = Field(description="one line: what passed")


class Descriptor(BaseModel):
    """Everything a worker advertises (docs/wire.md, "Metrics and the descriptor")."""

    model_config = STRICT
    schema_version: int = SCHEMA_VERSION
    address: str = Field(description="HOST:PORT the worker serves on, as it names itself")
    identity: CompatIdentity
    capacity: Capacity
    load: Load
    seam: SeamCost
    health: Health
    security: Security
    certificates: tuple[HeldCertificate, ...] = Field(description="only those matching the identity exactly")
    metrics: str = Field(description="the Prometheus endpoint (http(s)://HOST:PORT/metrics); '' if none")

    @field_validator("schema_version")
    @classmethod
    def _version(cls, v: int) -> int:
        if v != SCHEMA_VERSION:
            raise ValueError(f"descriptor schema version {v}; this dgr reads version {SCHEMA_VERSION}")
        return v

    def summary(self) -> str:
        """A few readable lines (`dgr worker describe` without --json)."""
        i, c, ld, h = self.identity, self.capacity, self.load, self.health
        seam = self.seam.seam_out
        cost = "samples (last stage)"
        if seam is not None:
            every = ", ".join(f"{k} {v}" for k, v in seam.bytes_per_token.items())
            cost = f"{seam.bytes_per_token[seam.wire_dtype]} B/token out at layer {seam.layer} ({seam.wire_dtype}; {every})"
        errs = ", ".join(f"{k} {v}" for k, v in sorted(h.errors.items())) or "none"
        held = "; ".join(f"{x.id} ({x.contract}: {x.summary})" for x in self.certificates) or "none"
        sec = "mutual TLS" if self.security.mutual_tls else "TLS" if self.security.tls else "plaintext"
        mem = c.memory
        return "\n".join([
            f"{self.address}: stage {i.stage_index}/{i.stage_count} [{i.layer_begin}, {i.layer_end}) of "
            f"{i.n_layer} layers, model {i.model} ({i.arch}), bundle {i.bundle_id[:16]}",
            f"  engine {i.engine} on the {i.lane} lane, library blake3 {i.engine_blake3[:16]}, worker blake3 "
            f"{i.worker_blake3[:16] or '-'}, upstream {i.upstream_commit[:12] or '-'}, patches {i.patch_series[:16] or '-'}",
            f"  capacity: {c.max_sessions} sessions x {c.n_ctx} positions, queue {c.max_queued_steps} steps; memory "
            f"weights {mem.weights_bytes} B, kv {mem.kv_bytes} B, compute {mem.compute_bytes} B",
            f"  step compute: decode median {c.decode.compute_ms_median:.2f} ms p90 {c.decode.compute_ms_p90:.2f} ms "
            f"({c.decode.steps} steps); prefill median {c.prefill.compute_ms_median:.2f} ms ({c.prefill.steps} steps)",
            f"  load: {ld.open_sessions} open sessions, {ld.queued_steps} queued steps, "
            f"{ld.cached_positions} cached positions",
            f"  seam: {cost}",
            f"  health: {'serving' if h.serving else 'draining'}, up {h.uptime_s:.0f} s, errors {errs}, reaped "
            f"{h.reaped_sessions}, overloaded {h.overloaded}, restarts {h.restarts}",
            f"  security: {sec}{f', member {self.security.member}' if self.security.member else ''}",
            f"  certificates: {held}",
            *([f"  metrics: {self.metrics}"] if self.metrics else []),
        ])


def schema_json() -> str:
    """The committed JSON schema's text (sorted keys, two-space indent, one trailing newline)."""
    return json.dumps(Descriptor.model_json_schema(), indent=2, sort_keys=True) + "\n"


__all__ = ["SCHEMA_PATH", "SCHEMA_VERSION", "Capacity", "CompatIdentity", "Descriptor", "HeldCertificate",
           "Health", "Load", "Memory", "Seam", "SeamCost", "Security", "StepTimes", "schema_json",
           "write_schema"]


def write_schema(root: Path | None = None) -> Path:
    """Write the schema file of this model into the checkout at `root` (default: this one)."""
    if root is None:
        root = REPO_ROOT
    path = Path(root) / SCHEMA_PATH
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(schema_json())
    return path


if __name__ == "__main__":
    print(write_schema())
