"""Whole-model baselines and split-run parity over the real engine.

A *schedule* fixes what is computed: the prompts (one session each), the number of greedy decode steps
and the physical batch size. `run_pipeline` runs a schedule through a list of engines in one process,
feeding each stage's boundary to the next (one engine = the whole model); all sessions share each
forward batch, prefill in one step, then one token per session per step. Decode inputs are the
baseline's greedy tokens (teacher forcing), so every step is compared even after a divergence.

The baseline is the whole model through the same library with no range (plain llama.cpp path, no
stage code); parity is exact when every logit is bit-for-bit equal (DESIGN.md section 4).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dgr.engine import Engine
from dgr.engine_api import Step
from dgr.errors import DgrError, EngineError

DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time, in a land far away,"


class ParityError(DgrError):
    """The split run does not reproduce the baseline (exit code 1, like a failed check)."""

    exit_code = 1


@dataclass
class Schedule:
    prompts: list[list[int]]                 # token ids per session
    steps: int = 8                           # greedy decode steps per session
    n_ubatch: int = 512
    forced: list[list[int]] | None = None    # decode inputs per session (None: the run's own greedy tokens)


@dataclass
class RunResult:
    prefill_logits: list[np.ndarray]         # per session [n_prompt, n_vocab]
    decode_logits: list[np.ndarray]          # per session [steps, n_vocab]
    generated: list[list[int]]               # per session greedy tokens: after the prompt, then after each step
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    boundary_bytes: list[int] = field(default_factory=list)  # per seam, bytes that crossed it


def open_stages(paths: list[Path], *, n_ubatch: int, n_ctx: int, max_sessions: int,
                ranges: list[tuple[int, int]] | None = None, lib: str | Path | None = None,
                n_threads: int = 0, kv_dtype: str = "f16") -> list[Engine]:
    engines: list[Engine] = []
    try:
        for i, p in enumerate(paths):
            engines.append(Engine.open(p, layer_range=ranges[i] if ranges else None, n_ctx=n_ctx,
                                       max_sessions=max_sessions, n_ubatch=n_ubatch, n_threads=n_threads, lib=lib,
                                       kv_dtype=kv_dtype))
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


def _forward_chain(engines: list[Engine], steps_tokens: list[tuple[str, np.ndarray, np.ndarray]], want: str,
                   perturb: tuple[int, int, int, float] | None, seam_bytes: list[int]):
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
                boundaries[k] = b
                seam_bytes[si] += b.nbytes
    return results


def run_pipeline(engines: list[Engine], sched: Schedule, *,
                 perturb: tuple[int, int, int, float] | None = None) -> RunResult:
    """Run `sched` through `engines` (stages in order). `perturb` = (stage, session, flat index, delta)
    adds delta to one value of that stage's output boundary in the prefill (negative controls)."""
    n = len(sched.prompts)
    sids = [f"s{k}" for k in range(n)]
    for eng in engines:
        for sid in sids:
            eng.open_session(sid, 0)
    seam = [0] * len(engines)
    try:
        t0 = time.perf_counter()
        pre = _forward_chain(engines, [(sids[k], np.arange(len(p), dtype=np.int32), np.asarray(p, dtype=np.int32))
                                       for k, p in enumerate(sched.prompts)], "all", perturb, seam)
        t1 = time.perf_counter()
        prefill = [r.logits for r in pre]
        gen = [[int(r.next_token)] for r in pre]
        dec: list[list[np.ndarray]] = [[] for _ in range(n)]
        for t in range(sched.steps):
            toks = [(sched.forced[k][t] if sched.forced else gen[k][t]) for k in range(n)]
            res = _forward_chain(engines, [(sids[k], np.array([len(sched.prompts[k]) + t], dtype=np.int32),
                                            np.array([toks[k]], dtype=np.int32)) for k in range(n)], "last", None, seam)
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
                     generated=gen, prefill_seconds=t1 - t0, decode_seconds=t2 - t1, boundary_bytes=seam[:-1])


# ------------------------------------------------------------------ baseline files

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
