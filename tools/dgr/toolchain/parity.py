"""Whole-model baselines and split-run parity over the real engine: run, compare, judge.

A *schedule* fixes what is computed: the prompts (one session each), the number of greedy decode steps
and the physical batch size. `run_pipeline` runs a schedule through a list of engines in one process,
feeding each stage's boundary to the next (one engine = the whole model); all sessions share each
forward batch, prefill in one step, then one token per session per step. Decode inputs are the
baseline's greedy tokens (teacher forcing), so every step is compared even after a divergence.

The baseline is the whole model through the same library with no range (plain llama.cpp path, no
stage code), with the bundle's weights: its source GGUF, or the recipe built as one stage when the recipe
quantized (dgr.toolchain.bundle.baseline_model); parity is exact when every logit is bit-for-bit equal
(docs/engine.md). `dgr baseline` and `dgr parity` (dgr.cli.commands.baseline and .parity) only parse arguments
and print what this module decides.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from dgr.core.constants import DEFAULT_N_UBATCH, DEFAULT_PROMPT, DEFAULT_STEPS
from dgr.core.errors import DgrError, EngineError
from dgr.core.hashing import file_blake3
from dgr.core.log import get_logger
from dgr.runtime.engine import Engine
from dgr.runtime.engine_api import Step
from dgr.toolchain.source import resolve

log = get_logger(__name__)

TOKENIZER_N_CTX = 64       # an engine opened only to tokenize prompts needs no real context


class ParityError(DgrError):
    """The split run does not reproduce the baseline (exit code 1, like a failed check)."""

    exit_code = 1


@dataclass
class Schedule:
    prompts: list[list[int]]                 # token ids per session
    steps: int = DEFAULT_STEPS               # greedy decode steps per session
    n_ubatch: int = DEFAULT_N_UBATCH
    forced: list[list[int]] | None = None    # decode inputs per session (None: the run's own greedy tokens)


@dataclass
class RunResult:
    prefill_logits: list[np.ndarray]         # per session [n_prompt, n_vocab]
    decode_logits: list[np.ndarray]          # per session [steps, n_vocab]
    generated: list[list[int]]               # per session greedy tokens: after the prompt, then after each step
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    boundary_bytes: list[int] = field(default_factory=list)  # per seam, bytes that crossed it
    numerics: str = ""                       # what the engines computed with (docs/numerics.md)


def ctx_for(prompts: list[list[int]], steps: int) -> int:
    """Positions each session needs to run a schedule: its longest prompt and every step, with room."""
    return max(64, max(len(p) for p in prompts) + steps + 8)


def open_tokenizer(model: str | Path, lib: str | Path | None = None) -> Engine:
    """A small engine over `model` to tokenize prompts with (the same model and library as the run)."""
    return Engine.open(model, n_ctx=TOKENIZER_N_CTX, max_sessions=1, lib=lib)


def make_schedule(engine: Engine, texts: list[str] | None, steps: int = DEFAULT_STEPS,
                  n_ubatch: int = DEFAULT_N_UBATCH) -> Schedule:
    """One session per prompt text (default: DEFAULT_PROMPT), tokenized by `engine` with specials."""
    if steps < 0:
        raise DgrError(f"--steps must be >= 0, got {steps}")
    texts = texts or [DEFAULT_PROMPT]
    prompts = [engine.tokenize(t, add_special=True) for t in texts]
    for t, p in zip(texts, prompts):
        if not p:
            raise DgrError(f"prompt {t!r} tokenizes to nothing; give a longer prompt")
    return Schedule(prompts=prompts, steps=steps, n_ubatch=n_ubatch)


def parse_ranges(text: str) -> list[tuple[int, int]]:
    """`0:10,10:30` -> [(0, 10), (10, 30)]."""
    try:
        return [tuple(int(x) for x in r.split(":")) for r in text.split(",")]  # type: ignore[misc]
    except ValueError:
        raise DgrError(f"--ranges {text!r}: write begin:end pairs separated by commas, e.g. 0:10,10:30") from None


def open_stages(paths: list[Path], *, n_ubatch: int, n_ctx: int, max_sessions: int,
                ranges: list[tuple[int, int]] | None = None, lib: str | Path | None = None,
                n_threads: int = 0, kv_dtype: str = "f16", fast_kernels: bool = False,
                n_draft_max: int = 0, kernels: str = "reference") -> list[Engine]:
    """`kernels`: the CPU kernel set (Engine.open); `fast_kernels=True` is kernels="fast"."""
    engines: list[Engine] = []
    try:
        for i, p in enumerate(paths):
            engines.append(Engine.open(p, layer_range=ranges[i] if ranges else None, n_ctx=n_ctx,
                                       max_sessions=max_sessions, n_ubatch=n_ubatch, n_threads=n_threads, lib=lib,
                                       kv_dtype=kv_dtype, fast_kernels=fast_kernels, n_draft_max=n_draft_max,
                                       kernels="fast" if fast_kernels else kernels))
    except BaseException:
        for e in engines:
            e.close()
        raise
    check_chain([e.describe() for e in engines])
    return engines


def check_chain(infos) -> None:
    """The stages must tile [0, n_layer) in order, with matching boundary schemas."""
    at = 0
    for i, s in enumerate(infos):
        if s.layer_begin != at:
            raise EngineError(f"stage {i} owns [{s.layer_begin}, {s.layer_end}) but the previous stage ended at {at}")
        if i and (s.n_embd, s.n_streams) != (infos[i - 1].n_embd, infos[i - 1].n_streams):
            raise EngineError(f"stage {i} boundary [{s.n_streams}, {s.n_embd}] does not match stage {i - 1}'s")
        at = s.layer_end
    if at != infos[0].n_layer:
        raise EngineError(f"the stages end at layer {at}, the model has {infos[0].n_layer}")


# (stage, session, boundary) -> the boundary the next stage takes: e.g. a wire dtype's encode + decode
BoundaryTransform = Callable[[int, int, np.ndarray], np.ndarray]


def _forward_chain(engines: list[Engine], steps_tokens: list[tuple[str, np.ndarray, np.ndarray]], want: str,
                   perturb: tuple[int, int, int, float] | None, seam_bytes: list[int], *,
                   boundary_transform: BoundaryTransform | None = None):
    """One forward of several sessions through every stage; returns the last stage's results."""
    boundaries: list[np.ndarray | None] = [None] * len(steps_tokens)
    results = None
    for si, eng in enumerate(engines):
        info = eng.describe()
        steps = []
        for k, (sid, pos, tok) in enumerate(steps_tokens):
            steps.append(Step(session_id=sid, epoch=0, positions=pos,
                              token_ids=tok if info.is_first or info.needs_token_ids else None,
                              boundary=None if info.is_first else boundaries[k], want_logits=want))
        results = eng.forward(steps)
        if not info.is_last:
            for k, r in enumerate(results):
                b = r.boundary
                if perturb and perturb[0] == si and perturb[1] == k:
                    b = b.copy()
                    b.flat[perturb[2]] += perturb[3]
                if boundary_transform is not None:
                    b = boundary_transform(si, k, b)
                boundaries[k] = b
                seam_bytes[si] += b.nbytes
    return results


def run_pipeline(engines: list[Engine], sched: Schedule, *,
                 perturb: tuple[int, int, int, float] | None = None,
                 boundary_transform: BoundaryTransform | None = None) -> RunResult:
    """Run `sched` through `engines` (stages in order). `perturb` = (stage, session, flat index, delta)
    adds delta to one value of that stage's output boundary in the prefill (negative controls).
    `boundary_transform(stage, session, boundary)` replaces every boundary a stage gives (prefill and
    decode) before the next stage takes it: dgr.app.bench.dtypes runs each through a wire dtype's codec."""
    numerics = {e.numerics for e in engines}
    if len(numerics) != 1:
        raise DgrError(f"the stages compute different numerics ({', '.join(sorted(numerics))}): open them from one "
                       "engine library with the same switches (docs/numerics.md)")
    n = len(sched.prompts)
    sids = [f"s{k}" for k in range(n)]
    for eng in engines:
        for sid in sids:
            eng.open_session(sid, 0)
    seam = [0] * len(engines)
    try:
        t0 = time.perf_counter()
        pre = _forward_chain(engines, [(sids[k], np.arange(len(p), dtype=np.int32), np.asarray(p, dtype=np.int32))
                                       for k, p in enumerate(sched.prompts)], "all", perturb, seam,
                             boundary_transform=boundary_transform)
        t1 = time.perf_counter()
        prefill = [r.logits for r in pre]
        gen = [[int(r.next_token)] for r in pre]
        dec: list[list[np.ndarray]] = [[] for _ in range(n)]
        for t in range(sched.steps):
            toks = [(sched.forced[k][t] if sched.forced else gen[k][t]) for k in range(n)]
            res = _forward_chain(engines, [(sids[k], np.array([len(sched.prompts[k]) + t], dtype=np.int32),
                                            np.array([toks[k]], dtype=np.int32)) for k in range(n)], "last", None, seam,
                                 boundary_transform=boundary_transform)
            for k, r in enumerate(res):
                dec[k].append(r.logits[0])
                gen[k].append(int(r.next_token))
        t2 = time.perf_counter()
    finally:
        for eng in engines:
            for sid in sids:
                try:
                    eng.close_session(sid, 0)
                except EngineError:
                    pass
    vocab = engines[-1].describe().n_vocab
    return RunResult(prefill_logits=prefill,
                     decode_logits=[np.stack(d) if d else np.zeros((0, vocab), np.float32) for d in dec],
                     generated=gen, prefill_seconds=t1 - t0, decode_seconds=t2 - t1, boundary_bytes=seam[:-1],
                     numerics=numerics.pop())


def run_baseline(model: str | Path, sched: Schedule, lib: str | Path | None = None, n_threads: int = 0,
                 kv_dtype: str = "f16", kernels: str = "reference") -> RunResult:
    """`sched` through the whole model alone (no range: llama.cpp's plain path)."""
    [eng] = open_stages([Path(model)], n_ubatch=sched.n_ubatch, n_ctx=ctx_for(sched.prompts, sched.steps),
                        max_sessions=len(sched.prompts), lib=lib, n_threads=n_threads, kv_dtype=kv_dtype,
                        kernels=kernels)
    try:
        info = eng.describe()
        if info.layer_begin != 0 or info.layer_end != info.n_layer:
            raise DgrError(f"{model} is a stage file (layers [{info.layer_begin}, {info.layer_end})); "
                           "a baseline needs the whole model")
        return run_pipeline([eng], sched)
    finally:
        eng.close()


def bundle_source(b, given: str | Path | None = None) -> Path:
    """The bundle's source GGUF, verified by the blake3 its manifest records: `given` (--source), or its URI."""
    want = b.manifest.source.blake3
    if given is not None:
        given = Path(given)
        if not given.is_file() or file_blake3(given) != want:
            raise DgrError(f"--source {given} is not the bundle's source (its manifest records blake3 {want[:16]}...)")
        return given
    try:
        return resolve(b.manifest.source.uri, want, base_dir=b.root, progress=False)
    except DgrError as e:
        raise DgrError(f"cannot find the bundle's source model to make a baseline ({e}); pass --source PATH "
                       "(the source GGUF), or --baseline FILE.npz from `dgr baseline`") from None


def token_counts(sched: Schedule) -> tuple[int, int]:
    """(prefill tokens, decode tokens) of a schedule, over all its sessions."""
    return sum(len(p) for p in sched.prompts), sched.steps * len(sched.prompts)


def throughput(sched: Schedule, res: RunResult) -> tuple[float, float]:
    """(prefill, decode) tokens per second of a run of `sched`."""
    n_pre, n_dec = token_counts(sched)
    return n_pre / max(res.prefill_seconds, 1e-9), n_dec / max(res.decode_seconds, 1e-9)


def perturbation(stage: int, n_stages: int) -> tuple[int, int, int, float]:
    """The negative control `run_pipeline(perturb=...)` takes: +1.0 on the first value of `stage`'s output
    boundary in session 0. A visible change: quantized matmuls round activations to 8 bits per block,
    so a tiny perturbation can vanish there and prove nothing."""
    if not 0 <= stage < n_stages - 1:
        raise DgrError(f"--perturb-boundary must name a non-last stage, 0..{n_stages - 2}")
    return (stage, 0, 0, 1.0)


# ------------------------------------------------------------------ baseline files

def baseline_meta(model: str | Path, sched: Schedule, res: RunResult, kv_dtype: str, device: str) -> dict:
    """What a baseline file records beside the logits: the model, its run's size and speed, the KV type."""
    n_pre, n_dec = token_counts(sched)
    return {"model": str(model), "prefill_tokens": n_pre, "decode_tokens": n_dec, "kv_dtype": kv_dtype,
            "device": device, "prefill_seconds": res.prefill_seconds, "decode_seconds": res.decode_seconds,
            "numerics": res.numerics}


def check_baseline_numerics(what: str, made: str | None, run: str, *, allow: bool = False) -> None:
    """A baseline compares bit for bit only with a run of its own numerics (docs/numerics.md): refuse another,
    unless `allow` (a comparison across lanes within a tolerance: said on stderr). `made` None: a baseline file
    from before baselines recorded it (compared, with a warning)."""
    if made is not None and made != run and allow:
        log.warning("%s was computed with numerics %r, this run computes %r: compared across numerics (allowed), so "
                    "only within the tolerance", what, made, run)
    elif made is None:
        log.warning("%s records no numerics (made before baselines did): if it was computed by another build, "
                    "instruction set or kernel switch, its logits differ in the low bits", what)
    elif made != run:
        raise DgrError(f"{what} was computed with numerics {made!r}, this run computes {run!r}: their results "
                       "differ in the low bits, so comparing them proves nothing. Make the baseline with the same "
                       "engine library and switches (`dgr baseline ... --lib`), or compare across numerics within a "
                       "tolerance (--allow-mixed-numerics --tolerance T), docs/numerics.md")


def baseline_kv_dtype(path: str | Path, meta: dict, requested: str | None) -> str:
    """The KV cache type to compare a baseline with: the one it was made with (like with like)."""
    made = meta.get("kv_dtype", "f16")
    if requested and requested != made:
        raise DgrError(f"{path} was made with a {made} KV cache; compare like with like "
                       f"(drop --kv-dtype, or make the baseline with --kv-dtype {requested})")
    return made


def save_baseline(path: str | Path, sched: Schedule, res: RunResult, meta: dict) -> Path:
    path = Path(path)
    arrays = {"schedule": np.frombuffer(json.dumps({"prompts": sched.prompts, "steps": sched.steps,
                                                    "n_ubatch": sched.n_ubatch}).encode(), dtype=np.uint8),
              "meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
              "generated": np.array(res.generated, dtype=np.int32)}
    for k in range(len(sched.prompts)):
        arrays[f"prefill_logits_{k}"] = res.prefill_logits[k]
        arrays[f"decode_logits_{k}"] = res.decode_logits[k]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    return path


def load_baseline(path: str | Path) -> tuple[Schedule, RunResult, dict]:
    try:
        z = np.load(Path(path), allow_pickle=False)
        s = json.loads(bytes(z["schedule"]).decode())
        meta = json.loads(bytes(z["meta"]).decode())
        gen = z["generated"].tolist()
        n = len(s["prompts"])
        res = RunResult(prefill_logits=[z[f"prefill_logits_{k}"] for k in range(n)],
                        decode_logits=[z[f"decode_logits_{k}"] for k in range(n)], generated=gen)
    except (OSError, KeyError, ValueError) as e:
        raise DgrError(f"{path}: not a dgr baseline file ({e}); make one with `dgr baseline MODEL.gguf -o FILE.npz`") from e
    sched = Schedule(prompts=s["prompts"], steps=s["steps"], n_ubatch=s["n_ubatch"],
                     forced=[g[:s["steps"]] for g in gen])
    return sched, res, meta


# ------------------------------------------------------------------ comparison

@dataclass
class Comparison:
    max_abs_diff: float
    first_diverging: tuple[int, str, int] | None   # (session, "prefill"|"decode", position) or None
    greedy_agree: bool
    n_values: int

    @property
    def exact(self) -> bool:
        return self.max_abs_diff == 0.0 and self.first_diverging is None

    def diverging_text(self) -> str:
        if self.first_diverging is None:
            return "none"
        return "yes (session %d, %s, position %d)" % self.first_diverging


def largest_logit(res: RunResult) -> float:
    """The largest |logit| of a run: the scale a difference is read against."""
    return max(float(abs(x).max()) for x in [*res.prefill_logits, *res.decode_logits] if x.size)


def verdict(c: Comparison, tolerance: float = 0.0) -> str:
    """"EXACT", or "WITHIN TOLERANCE (...)" when `tolerance` > 0 allows the difference; ParityError otherwise.
    A NaN difference never passes."""
    if tolerance < 0:
        raise DgrError(f"--tolerance must be >= 0, got {tolerance:g}")
    if c.exact:
        return "EXACT"
    if tolerance > 0 and c.max_abs_diff <= tolerance:  # NaN compares false: fails
        return f"WITHIN TOLERANCE (max abs {c.max_abs_diff:g} <= {tolerance:g})"
    why = "NaN in the logits" if math.isnan(c.max_abs_diff) else f"max abs {c.max_abs_diff:g}"
    if tolerance > 0:
        why += f" > tolerance {tolerance:g}"
    raise ParityError(f"parity FAILED: the split run differs from the whole model ({why})")


def compare(base: RunResult, run: RunResult) -> Comparison:
    worst = 0.0
    first = None
    n = 0
    for k in range(len(base.prefill_logits)):
        for phase, a_all, b_all, offset in (
                ("prefill", base.prefill_logits[k], run.prefill_logits[k], 0),
                ("decode", base.decode_logits[k], run.decode_logits[k], base.prefill_logits[k].shape[0])):
            if a_all.shape != b_all.shape:
                raise EngineError(f"session {k} {phase}: baseline logits {a_all.shape} vs run {b_all.shape}; "
                                  "was the baseline made with the same schedule?")
            n += a_all.size
            if a_all.size == 0:
                continue
            # bitwise comparison: NaN == NaN at the same place counts as equal
            diff_rows = np.nonzero(np.any(a_all.view(np.uint32) != b_all.view(np.uint32), axis=1))[0]
            d = np.abs(a_all.astype(np.float64) - b_all.astype(np.float64))
            worst = max(worst, float(np.nanmax(d)) if d.size else 0.0)
            # sessions in order, prefill before decode: the first hit is the earliest position
            if diff_rows.size and first is None:
                first = (k, phase, offset + int(diff_rows[0]))
    greedy = [g[: len(run.generated[k])] for k, g in enumerate(base.generated)] == run.generated
    if first is not None and worst == 0.0:
        worst = float("nan")  # differing bits with no numeric difference: NaN placement or -0.0
    return Comparison(max_abs_diff=worst, first_diverging=first, greedy_agree=greedy, n_values=n)


def split_compare(model, sched: Schedule, base, ranges, *, lib=None, n_threads: int = 0):
    """`model` split at `ranges` (one engine per range, in this process) run through `sched`, compared with
    the whole model's run `base` (run_baseline of the same schedule)."""
    engines = open_stages([model] * len(ranges), n_ubatch=sched.n_ubatch, n_ctx=ctx_for(sched.prompts, sched.steps),
                          max_sessions=len(sched.prompts), ranges=ranges, lib=lib, n_threads=n_threads)
    try:
        run = run_pipeline(engines, sched)
    finally:
        for e in engines:
            e.close()
    return compare(base, run)
