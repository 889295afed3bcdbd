"""`dgr certify`: a bundle's stages in worker processes against its whole model, judged by a contract.

In order: the recipe the bundle was built from is re-read (an MTP-on recipe is refused before anything
runs); the whole model runs alone on the engine library in this process (the independent baseline:
greedy tokens and logits of every contract prompt, prefilled in the route's chunks): the source GGUF, or
when the recipe quantized, the same recipe built as one stage (dgr.toolchain.bundle.baseline_model, as `dgr
parity` does: the whole model with the bundle's weights); then one
`dgr worker serve` process per stage (dgr.app.local.LocalRoute) serves the bundle on loopback and the
same prompts run through the route; tokens must be equal and logits bit-identical. Then the route's features
(dgr.app.certify.features): the prefix cache (a kept prefix restored equals the cold run) and, last, recovery
from a kill -9 of the middle stage (its replica started with the route). Where the contract's speed gate
applies, pipeline and whole model run side by side on the same host, alternating which goes first
(measure_speed), and the per-round ratios are judged by dgr.app.certify.speed.speed_figures, a pure function
(passed, failed, or inconclusive when their spread covers the threshold). The result is a
dgr.core.certificate.Certificate, whose `passed` is every figure's (dgr.app.certify.verdict: its verdict).
"""

from __future__ import annotations

import datetime as dt
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dgr import __version__
from dgr.app.certify.contract import Contract, LoadedContract, load_contract, mtp_refused
from dgr.app.certify.features import Fault, prefix_cache_row, recovery_row
from dgr.app.certify.host import host, usable_cores
from dgr.app.certify.speed import SpeedRuns, speed_figures
from dgr.app.demo import long_prompt, whole_model_run
from dgr.app.local import LocalRoute
from dgr.core.certificate import Certificate, ContractRef, Figure, Identity, StageRange
from dgr.core.errors import DgrError, RecipeError
from dgr.core.hashing import file_blake3
from dgr.core.log import get_logger
from dgr.core.paths import default_engine_library
from dgr.gguf.model import read_header
from dgr.runtime.engine import Engine
from dgr.runtime.wire.client import RouteClient
from dgr.toolchain.bundle import baseline_model, load_bundle
from dgr.toolchain.enginebuild import ensure_engine
from dgr.toolchain.parity import bundle_source
from dgr.toolchain.recipe import parse_recipe

log = get_logger(__name__)

SYNTH_NAME_PREFIX = "dgr-synth-"      # general.name of every `dgr synth` model (random weights)


class CertifyError(DgrError):
    """Certification could not run (a refused recipe, a missing engine, workers that disagree)."""


def engine_library(lane: str, lib: str | Path | None = None) -> Path:
    """The engine library to certify: `lib`, $DGR_ENGINE_LIB, or the lane's workspace build (the CPU
    lane's is built when missing, as `dgr demo` does)."""
    if lib or os.environ.get("DGR_ENGINE_LIB"):
        p = Path(lib or os.environ["DGR_ENGINE_LIB"])
    else:
        p = default_engine_library(lane)
        if not p.is_file() and lane == "cpu":
            p = ensure_engine("cpu")
    if not p.is_file():
        raise CertifyError(f"no engine library for the {lane} lane at {p}: `dgr build-engine --lane {lane}`, "
                           "or point --engine-lib / $DGR_ENGINE_LIB at one")
    return p.resolve()


def mtp_off(bundle) -> Figure:
    """The MTP-off row of a bundle: its recipe (as recorded in the manifest) must not turn MTP on, and no
    stage may hold a layer past the main ones. Raises CertifyError for an MTP-on recipe."""
    m = bundle.manifest
    try:
        recipe = parse_recipe(m.recipe.text, f"{bundle.root}/manifest.json recipe")
    except RecipeError as e:
        raise CertifyError(f"refused before anything runs: {e}") from e
    if recipe.bundle.include_mtp:
        raise CertifyError("refused before anything runs: " + mtp_refused(f"{bundle.root}/manifest.json recipe"))
    extra = m.model.n_layer_all - m.model.n_layer
    inside = [s.index for s in m.stages if s.layer_end > m.model.n_layer]
    ok = not recipe.bundle.include_mtp and not inside and m.stages[-1].layer_end == m.model.n_layer
    fig = (f"{extra} MTP block(s) left out ({len(m.excluded_tensors)} tensors)" if extra
           else "the source has no MTP layers")
    return Figure(check="MTP off", figure=fig, threshold="include_mtp off; no stage past layer "
                  f"{m.model.n_layer}", passed=ok,
                  detail="" if ok else f"stages {inside} hold layers past the main {m.model.n_layer}")


def source_of(bundle, source: str | Path | None = None) -> Path:
    """The bundle's source GGUF, verified against the blake3 its manifest records (`dgr parity`'s lookup)."""
    try:
        return bundle_source(bundle, source)
    except CertifyError:
        raise
    except DgrError as e:
        raise CertifyError(f"the bundle's source GGUF is needed for the whole-model baseline: {e}") from None


def is_synthetic(source: Path) -> bool:
    name = read_header(source).get("general.name")
    return isinstance(name, str) and name.startswith(SYNTH_NAME_PREFIX)


def parity_prompts(c: Contract, tokenize, n_vocab: int) -> list[list[int]]:
    ids = [tokenize(t) for t in c.parity.prompts]
    rng = np.random.default_rng(c.parity.seed)
    ids += [rng.integers(0, min(n_vocab, 256), size=n).tolist() for n in c.parity.random_prompts]
    if any(not p for p in ids):
        raise CertifyError("a contract prompt tokenizes to nothing")
    return ids


@dataclass
class _Parity:
    tokens_equal: int = 0
    tokens_total: int = 0
    rows: int = 0
    rows_missing: int = 0
    max_diff: float = 0.0
    prompts: int = 0


def _compare(p: _Parity, gen, ids: list[int], ref) -> None:
    p.prompts += 1
    p.tokens_total += len(ref.token_ids)
    p.tokens_equal += sum(a == b for a, b in zip(gen.token_ids, ref.token_ids))   # position by position
    for k, want in enumerate(ref.logits):
        got = gen.logits.get(len(ids) - 1 + k)
        if got is None or got.shape != want.shape:
            p.rows_missing += 1
            continue
        p.rows += 1
        d = float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))))
        p.max_diff = max(p.max_diff, d if np.isfinite(d) else float("inf"))


def _parity_figures(p: _Parity, c: Contract, n_vocab: int, baseline: str) -> list[Figure]:
    """The parity rows; `baseline` says what the whole model was (the source, or the recipe as one stage)."""
    tol = c.parity.max_abs_logit_diff
    return [
        Figure(check="parity: greedy tokens", figure=f"{p.tokens_equal}/{p.tokens_total}", threshold="all equal",
               passed=p.tokens_total > 0 and p.tokens_equal == p.tokens_total,
               detail=f"{p.prompts} prompts x {c.parity.max_new_tokens} tokens, prefill chunks of "
                      f"{c.parity.chunk_tokens}"),
        Figure(check="parity: max |logit diff|", figure=p.max_diff, threshold="== 0" if tol == 0 else f"<= {tol}",
               passed=p.rows > 0 and p.rows_missing == 0 and p.max_diff <= tol,
               detail=f"{p.rows} rows x {n_vocab} logits compared" +
                      (f", {p.rows_missing} rows missing" if p.rows_missing else "") +
                      f"; whole model: {baseline}"),
    ]


def checked_identity(bundle, descs, lane: str, lib: Path, chash: str, whole_numerics: str | None = None) -> Identity:
    """The identity the workers advertise (Describe), checked against the bundle and this host's engine: every
    stage and the whole-model baseline (`whole_numerics`, where there is one) must compute the same numerics
    (docs/numerics.md), or the rows would compare unlike with unlike."""
    first = descs[0].identity
    numerics = first.numerics if whole_numerics is None else whole_numerics
    for i, d in enumerate(descs):
        if d.identity.numerics != numerics:
            raise CertifyError(f"stage {i} computes {d.identity.numerics!r}, " +
                               ("stage 0" if whole_numerics is None else "the whole-model baseline") +
                               f" {numerics!r}: a certificate holds for one numerics (docs/numerics.md)")
    for i, d in enumerate(descs):
        idn = d.identity
        got = (idn.bundle_id, idn.stage_index, idn.lane, idn.model, idn.upstream_commit, idn.patch_series)
        want = (bundle.id, i, lane, bundle.manifest.recipe.name, first.upstream_commit, first.patch_series)
        if got != want:
            raise CertifyError(f"worker of stage {i} advertises {got}, expected {want}")
    # the worker binary each stage ran (its descriptor's worker_blake3: dgr-worker hashes its own executable)
    workers = [json.loads(d.descriptor_json or "{}").get("identity", {}).get("worker_blake3", "") for d in descs]
    if not workers[0] or len(set(workers)) != 1:
        raise CertifyError(f"the stages' workers name the worker binaries {workers} (descriptor identity "
                           "worker_blake3): certify needs every stage served by one and the same dgr-worker")
    return Identity(model=first.model, bundle_id=bundle.id, lane=lane, upstream_commit=first.upstream_commit,
                    patch_series=first.patch_series, engine_blake3=file_blake3(lib), worker_blake3=workers[0],
                    contract_blake3=chash, numerics=numerics)


def _processes(route, n_stages: int) -> Figure:
    """How many distinct, still running worker processes served the parity runs (one per stage)."""
    alive = {p.pid for p in route.procs if p.poll() is None}
    return Figure(check="stages in worker processes", figure=len(alive), threshold=f"== {n_stages}",
                  passed=len(alive) == n_stages and len(set(route.addresses)) == n_stages,
                  detail=f"one `dgr worker serve` per stage on {', '.join(route.addresses)}" +
                         "".join(f" (and a replica of stage {i} on {', '.join(r[1:])}, for the recovery row)"
                                 for i, r in enumerate(route.replicas) if len(r) > 1))


def measure_speed(c: Contract, client, eng, threads: int) -> SpeedRuns:
    """Pipeline and whole model side by side on this host, one untimed round and then `repeats` timed ones,
    alternating which goes first (the pipeline in even rounds): tok/s of each side in each timed round. What
    they are judged by is dgr.app.certify.speed.speed_figures."""
    s = c.speed
    short = eng.tokenize(s.prompt)
    long_ids = long_prompt(eng.tokenize, s.prefill_tokens)
    chunk = client.chunk_tokens
    measure = {                                     # each pair (decode, prefill) runs back to back
        "pd": lambda: client.run(short, max_new_tokens=s.decode_tokens, stop_token_ids=[]).decode_tokens_per_s,
        "wd": lambda: whole_model_run(eng, short, s.decode_tokens, chunk_tokens=chunk).decode_tokens_per_s,
        "pp": lambda: client.run(long_ids, max_new_tokens=1, stop_token_ids=[]).prefill_tokens_per_s,
        "wp": lambda: whole_model_run(eng, long_ids, 1, chunk_tokens=chunk).prefill_tokens_per_s,
    }
    got: dict[str, list[float]] = {key: [] for key in measure}
    for k in range(s.repeats + 1):                  # the first round warms both up and is not counted
        pipeline_first = k % 2 == 1                 # timed round k - 1: the pipeline first when it is even
        for key in ("pd", "wd", "pp", "wp") if pipeline_first else ("wd", "pd", "wp", "pp"):
            x = measure[key]()
            if k:
                got[key].append(x)
    pd, wd, pp, wp = (got[key] for key in ("pd", "wd", "pp", "wp"))
    return SpeedRuns(prefill_tokens=len(long_ids), threads=threads, pipeline_decode=tuple(pd),
                     whole_decode=tuple(wd), pipeline_prefill=tuple(pp), whole_prefill=tuple(wp))


def certify(bundle_path: str | Path, *, contract: LoadedContract | str | Path | None = None,
            lane: str | None = None, lib: str | Path | None = None, source: str | Path | None = None,
            threads: int | None = None, log_dir: Path | None = None) -> Certificate:
    """Certify the bundle at `bundle_path` against `contract` (default certification/alpha.toml) on
    `lane` (default: the contract's). Returns the certificate; `passed` says whether every row passed."""
    lc = contract if isinstance(contract, LoadedContract) else load_contract(contract)
    c = lc.contract
    lane = lane or c.lane
    b = load_bundle(bundle_path)
    figures = [mtp_off(b)]                          # refuses an MTP-on recipe before anything runs
    lib = engine_library(lane, lib)
    src = source_of(b, source)
    whole = baseline_model(b, src, progress=True)   # the source, or the recipe built as one stage
    n_stages = len(b.manifest.stages)
    cores = usable_cores()
    threads = threads or c.threads(n_stages, cores)
    speed = c.speed is not None and (c.speed.applies_to == "all" or
                                     (c.speed.applies_to == "real-weights" and not is_synthetic(src)))
    n_ctx = c.parity.n_ctx
    if speed:
        n_ctx = max(n_ctx, c.speed.prefill_tokens + 16, c.speed.decode_tokens + 64)
    log.info("certify: bundle %s (%d stages) on the %s lane, engine %s, %d thread(s) per process; "
             "whole model: %s", b.root.name, n_stages, lane, lib, threads, whole)

    eng = Engine.open(whole.path, lib=lib, n_threads=threads, n_ctx=n_ctx)
    try:
        if eng.lane != lane:
            raise CertifyError(f"--lane {lane}: the engine library {lib} is built for the {eng.lane} lane")
        n_vocab = eng.describe().n_vocab
        prompts = parity_prompts(c, eng.tokenize, n_vocab)
        if max(map(len, prompts)) + c.parity.max_new_tokens > n_ctx:
            raise CertifyError(f"a parity prompt of {max(map(len, prompts))} tokens does not fit n_ctx {n_ctx}")
        chunk = c.parity.chunk_tokens
        baseline = {chunk: [whole_model_run(eng, ids, c.parity.max_new_tokens, chunk_tokens=chunk) for ids in prompts]}
        args = [["--bundle", str(b.root), "--stage", str(i), "--threads", str(threads), "--n-ctx", str(n_ctx)]
                for i in range(n_stages)]
        # the feature rows run the longest parity prompt; the recovery row's victim is told where to die now
        longest = max(range(len(prompts)), key=lambda k: len(prompts[k]))
        fault = Fault.plan(n_stages, len(prompts[longest]), c.parity.max_new_tokens)
        with LocalRoute(args, env={"DGR_ENGINE_LIB": str(lib)}, timeout=300, log_dir=log_dir,
                        replicas=fault.replicas(n_stages), extra=fault.extra) as route, \
                RouteClient(route.addresses, chunk_tokens=chunk, prefix_cache=False) as client:
            descs = client.describe()
            identity = checked_identity(b, descs, lane, lib, lc.blake3, eng.numerics)
            if client.chunk_tokens not in baseline:  # the message limit made the route's chunks smaller
                baseline[client.chunk_tokens] = [whole_model_run(eng, ids, c.parity.max_new_tokens,
                                                                 chunk_tokens=client.chunk_tokens) for ids in prompts]
            par, cold = _Parity(), []
            for ids, ref in zip(prompts, baseline[client.chunk_tokens]):
                gen = client.run(ids, max_new_tokens=c.parity.max_new_tokens, logits="last", stop_token_ids=[])
                _compare(par, gen, ids, ref)
                cold.append(gen)                    # the route's own run, prefix cache off: what the rows compare with
            figures += _parity_figures(par, c, n_vocab, str(whole))
            figures.append(_processes(route, n_stages))
            figures.append(prefix_cache_row(client, descs, prompts[longest], cold[longest], c.parity.max_new_tokens))
            if speed:
                figures += speed_figures(measure_speed(c, client, eng, threads), c.speed)
            # last: it leaves a worker dead
            figures.append(recovery_row(route, fault, prompts[longest], cold[longest], c.parity.max_new_tokens,
                                        client.chunk_tokens))
    finally:
        eng.close()
    cert = Certificate(
        identity=identity, contract=ContractRef(path=lc.ref_path, blake3=lc.blake3, name=c.name), hardware=host(),
        stages=tuple(StageRange(stage=s.index, layer_begin=s.layer_begin, layer_end=s.layer_end)
                     for s in b.manifest.stages),
        figures=tuple(figures), passed=all(f.passed for f in figures),
        created_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), dgr_version=__version__)
    log.info("certify: %s: %s", b.root.name, "passed" if cert.passed else "FAILED")
    return cert
