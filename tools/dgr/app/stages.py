"""Where a worker's engine and identity come from: a bundle stage (verified, on the real engine) or a
fake-model spec (tests), and which certificates (`dgr certify`) it may advertise."""

from __future__ import annotations

from pathlib import Path

import gguf

from dgr.constants import DEFAULT_MAX_SESSIONS, DEFAULT_N_CTX
from dgr.contract import DEFAULT_WIRE_DTYPE
from dgr.descriptor import HeldCertificate
from dgr.engine_api import ShardEngine
from dgr.errors import WireError
from dgr.hashing import file_blake3
from dgr.log import get_logger
from dgr.wire.worker import StageIdentity

log = get_logger(__name__)


def fake_stage(spec: str, stage: int, wire_dtype: str = DEFAULT_WIRE_DTYPE) -> tuple[ShardEngine, StageIdentity]:
    """Stage `stage` of the fake model `spec` (see dgr.testing.fake_engine); the bundle id hashes the spec."""
    # The test double, imported only when a fake stage is asked for (`dgr worker serve --fake-engine`).
    from dgr.testing import fake_engine
    from dgr.testing.fake_engine import FakeEngine, FakeModel

    model = FakeModel.from_spec(spec)
    engine = FakeEngine(model, stage)
    ident = StageIdentity(model=f"fake:{model.to_spec()}", bundle_id=model.bundle_id, stage_index=stage,
                          stage_count=len(model.ranges), lane="cpu", engine="fake", wire_dtype=wire_dtype,
                          eos_token_ids=engine.vocab().stop_ids,
                          engine_blake3=file_blake3(fake_engine.__file__, threads=False))   # its "library"
    return engine, ident


def patch_series() -> tuple[str, str]:
    """(upstream commit, hash over the ordered patch stack): the release's metadata, or the checkout's pin."""
    from dgr.buildinfo import build_info

    info = build_info()
    return info.commit, info.patch_series


def checked_bundle(path: str | Path, stage: int, *, verify: bool = True):
    """The bundle at `path`, once `stage` is one of its stages and (`verify`) its files match the
    manifest's hashes; WireError saying which otherwise."""
    from dgr.bundle import load_bundle, verify_bundle
    from dgr.locks import locked
    from dgr.paths import workspace

    b = load_bundle(path)
    n = len(b.manifest.stages)
    if not 0 <= stage < n:
        raise WireError(f"bundle {b.root} has {n} stages (0..{n - 1}); there is no stage {stage}")
    if verify:
        # Workers of one bundle usually start together; verify one at a time (the later ones find the
        # chunks already checked in the resumable verify state).
        with locked(workspace() / "state" / "locks" / f"verify-{b.id[:16]}.lock"):
            verify_bundle(b.root)
    return b


def bundle_stage(path: str | Path, stage: int, *, lane: str | None = None, wire_dtype: str | None = None,
                 n_ctx: int = DEFAULT_N_CTX, max_sessions: int = DEFAULT_MAX_SESSIONS, n_threads: int = 0,
                 verify: bool = True) -> tuple[ShardEngine, StageIdentity]:
    """Open stage `stage` of the bundle at `path` on the real engine (after checking its hashes)."""
    from dgr.engine import Engine, library_path
    from dgr.ggufmodel import read_header

    b = checked_bundle(path, stage, verify=verify)
    stages = b.manifest.stages
    entry = stages[stage]
    file = b.stage_path(stage)
    engine = Engine.open(file, n_ctx=n_ctx, max_sessions=max_sessions, n_threads=n_threads)
    if lane is not None and lane != engine.lane:
        engine.close()
        raise WireError(f"--lane {lane}: the engine library was built for the {engine.lane} lane, and a worker "
                        f"advertises its engine's lane; start it with the {lane} lane's engine ($DGR_ENGINE_LIB, "
                        f"or `bazel run //worker:worker_{lane}`), or drop --lane")
    lane = engine.lane
    info = engine.describe()
    if (info.layer_begin, info.layer_end) != (entry.layer_begin, entry.layer_end):
        engine.close()
        raise WireError(f"{file}: the engine opened layers [{info.layer_begin}, {info.layer_end}) but the "
                        f"manifest says [{entry.layer_begin}, {entry.layer_end}): rebuild the bundle")
    sch = entry.boundary_in
    if sch is not None and (sch.n_streams, sch.n_embd, sch.token_ids) != \
            (info.n_streams, info.n_embd, info.needs_token_ids):
        engine.close()
        raise WireError(f"{file}: the manifest says stage {stage} takes [n, {sch.n_streams}, {sch.n_embd}]"
                        f"{' +token ids' if sch.token_ids else ''} but the engine takes [n, {info.n_streams}, "
                        f"{info.n_embd}]{' +token ids' if info.needs_token_ids else ''}: rebuild the bundle "
                        "with this dgr, or use the engine it was built for")
    header = read_header(file)
    template = header.get(gguf.Keys.Tokenizer.CHAT_TEMPLATE)
    # every id that ends a generation as llama.cpp sees it (eos, eot, eom, <|im_end|>, ...), the eos first:
    # a model whose end of turn is not its eos stops at the end of a turn, as under llama-server
    stops = engine.vocab().stop_ids
    commit, series = patch_series()
    ident = StageIdentity(model=b.manifest.recipe.name, bundle_id=b.id, stage_index=stage,
                          stage_count=len(stages), upstream_commit=commit, patch_series=series, lane=lane,
                          engine="llama.cpp", wire_dtype=wire_dtype or b.manifest.boundary_dtype,
                          eos_token_ids=stops,
                          chat_template=template if isinstance(template, str) else "",
                          engine_blake3=file_blake3(library_path().resolve()))
    return engine, ident


def python_worker_blake3() -> str:
    """The Python worker's (`--python-worker`, tests only) stand-in for a worker binary's blake3: its source
    (dgr.wire.worker), as the fake engine's "library" is its source. A certificate `dgr certify` makes names
    dgr-worker's executable, so this worker advertises only certificates written for it (tests)."""
    from dgr.wire import worker

    return file_blake3(worker.__file__, threads=False)


def held_certificates(directory: str | Path, ident: StageIdentity, layers: tuple[int, int],
                      contract: str | Path | None = None, worker_blake3: str | None = None
                      ) -> tuple[HeldCertificate, ...]:
    """The certificates among DIR/*.json a worker of `ident` serving `layers` may advertise: those whose
    identity equals its own exactly (dgr.certificate.check: the worker binary's blake3 too, `worker_blake3`,
    default the Python worker's, python_worker_blake3), that cover its stage, and whose contract file
    (`contract`, else the path each records) still has the hash they were measured against. Every other one
    is logged with the reason and ignored."""
    from dgr import certificate as cm

    d = Path(directory)
    if not d.is_dir():
        raise WireError(f"--certs {d}: no such directory (put the certificates `dgr certify` wrote there)")
    if contract is not None and not Path(contract).is_file():
        raise WireError(f"--contract {contract}: no such file")
    mine = cm.Identity(model=ident.model, bundle_id=ident.bundle_id, lane=ident.lane,
                       upstream_commit=ident.upstream_commit, patch_series=ident.patch_series,
                       engine_blake3=ident.engine_blake3,
                       worker_blake3=python_worker_blake3() if worker_blake3 is None else worker_blake3,
                       contract_blake3=cm.contract_hash(contract) if contract is not None else "")
    held = []
    for path in sorted(d.glob("*.json")):
        try:
            cert = cm.load_certificate(path)
        except cm.CertificateError as err:
            log.warning("ignoring %s: %s", path.name, err)
            continue
        why = cm.check(cert, mine, contract)
        covered = {(r.stage, r.layer_begin, r.layer_end) for r in cert.stages}
        if why is None and covered and (ident.stage_index, *layers) not in covered:
            why = (f"certificate covers stages {sorted(covered)}, not stage {ident.stage_index} "
                   f"[{layers[0]}, {layers[1]})")
        if why is not None:
            log.warning("ignoring certificate %s (lane %s): %s", path.name, cert.identity.lane, why)
            continue
        hw = cert.hardware
        n_pass = sum(f.passed for f in cert.figures)
        held.append(HeldCertificate(
            id=cert.digest, contract=cert.contract.name or cert.contract.path, contract_blake3=cert.contract.blake3,
            lane=cert.identity.lane, issued_at=cert.created_at,
            summary=f"{n_pass}/{len(cert.figures)} checks passed on {hw.cpu_model}{f' + {hw.gpu}' if hw.gpu else ''}"))
        log.info("advertising certificate %s (%s, lane %s)", path.name, cert.digest[:16], cert.identity.lane)
    return tuple(held)
