"""Features that keep or drop a session's cached positions, on one architecture, against the whole model run cold.

The family suite (dgr.toolchain.synth.parity) proves a split equals the whole model; these prove the
engine calls a worker makes around it, on the same tiny model split in three (parity's cuts), in this
process, every stage doing what its worker would:

- **prefix cache** (docs/worker.md "Prefix cache"): a session loads what an earlier one's layers held
  (`Engine.state_get` / `state_set`), all of it (`restore`) or cut back to a shorter prefix (`cut back`: 24 of
  48 positions, past the sliding window and the ubatch), prefills the rest and decodes;
- **rollback** (speculative decoding, docs/speculation.md): a verification step carries drafts, one of them
  wrong; every stage drops the rejected positions (`Engine.truncate`) and decoding goes on.

Each must give every logits row bit-identical to the whole model's cold run (decode fed the cold run's
tokens), or the engine refuses by name: the cell then says `refused: ...`, in the words the worker's
Describe uses (`prefix_cache_off`; `can_roll_back: false` for rollback).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from dgr.core.errors import EngineError, Unsupported
from dgr.runtime.engine_api import Step
from dgr.runtime.wire.limits import Limits
from dgr.toolchain.parity import RunResult, Schedule, ctx_for, open_stages, run_baseline
from dgr.toolchain.synth.generic import layer_kinds
from dgr.toolchain.synth.parity import EMBD, N_UBATCH, choose_ranges, model_layers, synth_model

KEEP = 24        # the restored prefix: three sliding windows of the tiny models (8), more than a ubatch (16)
RAN = 48         # what the cut-back case's first session ran
PROMPT = 70      # the prompt every case completes
STEPS = 4
_OWN = {"deepseek4": (150, 64, 64, 100)}     # its compressors need longer prompts: (prompt, keep, ubatch, ran)


@dataclass
class FeatureResult:
    arch: str
    feature: str
    verdict: str            # "exact", "refused: <why>" or "DIFFERS (...)"
    seconds: float

    @property
    def exact(self) -> bool:
        return self.verdict == "exact"

    @property
    def refused(self) -> bool:
        return self.verdict.startswith("refused")


def _chain(engines, sid: str, pos0: int, tokens, want: str):
    """One forward of `tokens` at positions pos0... through every stage; the last stage's result."""
    boundary = None
    res = None
    for eng in engines:
        info = eng.describe()
        [res] = eng.forward([Step(session_id=sid, epoch=0,
                                  positions=np.arange(pos0, pos0 + len(tokens), dtype=np.int32),
                                  token_ids=np.asarray(tokens, np.int32) if info.is_first or info.needs_token_ids
                                  else None,
                                  boundary=boundary, want_logits=want)])
        boundary = res.boundary
    return res


def _differs(got: np.ndarray, want: np.ndarray) -> bool:
    return got.shape != want.shape or not np.array_equal(got.view(np.uint32), want.view(np.uint32))


def _first_differing(got: np.ndarray, want: np.ndarray) -> int | None:
    return next((k for k in range(len(got)) if _differs(got[k], want[k])), None) if _differs(got, want) else None


class Case:
    """Stage engines of one model (opened as workers open them, one session at a time), a prompt, and the whole
    model's cold run of it: `base_prefill` [n_prompt, vocab], `base_decode` [steps, vocab], `tokens` its greedy
    tokens (after the prompt, then after each decode step). `keep`/`ran`: the prefix cases' lengths."""

    def __init__(self, engines, prompt: list[int], base_prefill: np.ndarray, base_decode: np.ndarray,
                 tokens: list[int], keep: int, ran: int):
        self.engines, self.prompt, self.keep, self.ran = engines, list(prompt), keep, ran
        self.base_prefill, self.base_decode, self.tokens = base_prefill, base_decode, list(tokens)

    @classmethod
    def synth(cls, arch: str, workdir: Path, lib, n_threads: int, kernels: str = "reference") -> "Case":
        """A tiny model of `arch` split in three (parity's cuts), on the `kernels` set (Engine.open) in the
        baseline and every stage; the caller closes the engines."""
        n_prompt, keep, n_ubatch, ran = _OWN.get(arch, (PROMPT, KEEP, N_UBATCH, RAN))
        layers = model_layers(arch)
        ranges = choose_ranges(layer_kinds(arch, layers, EMBD), 3)
        model = synth_model(arch, Path(workdir) / f"{arch}-{layers}L-features.gguf", layers=layers)
        prompt = np.random.default_rng(11).integers(0, 256, size=n_prompt).tolist()
        base: RunResult = run_baseline(model, Schedule(prompts=[prompt], steps=STEPS, n_ubatch=n_ubatch), lib,
                                       n_threads, kernels=kernels)
        # as a worker opens its engine: rollback depth from Limits().draft_max (V4's snapshots)
        engines = open_stages([model] * 3, n_ubatch=n_ubatch, n_ctx=ctx_for([prompt], STEPS + 4), max_sessions=2,
                              ranges=ranges, lib=lib, n_threads=n_threads, n_draft_max=Limits().draft_max,
                              kernels=kernels)
        return cls(engines, prompt, base.prefill_logits[0], base.decode_logits[0], base.generated[0], keep, ran)

    def close(self) -> None:
        for e in self.engines:
            e.close()

    @contextmanager
    def session(self, sid: str):
        """`sid` open on every stage for the block, closed after it."""
        for e in self.engines:
            e.open_session(sid, 0)
        try:
            yield sid
        finally:
            for e in self.engines:
                try:
                    e.close_session(sid, 0)
                except EngineError:
                    pass

    def decode(self, sid: str, start: int) -> str:
        """Decode steps `start`.. fed the cold run's tokens; '' when every row equals the cold run's."""
        n = len(self.prompt)
        for t in range(start, len(self.base_decode)):
            r = _chain(self.engines, sid, n + t, [self.tokens[t]], "last")
            if _differs(r.logits[0], self.base_decode[t]):
                return f"decode step {t} differs"
        return ""


def _restore(case: Case, ran: int, keep: int, tag: str) -> str:
    with case.session(f"{tag}-saver") as saver:
        _chain(case.engines, saver, 0, case.prompt[:ran], "none")
        states = [e.state_get(saver, 0) for e in case.engines]
    with case.session(f"{tag}-user") as user:
        for e, (state, n_pos) in zip(case.engines, states):
            if n_pos != ran:
                return f"{tag}: a stage saved {n_pos} positions, the session ran {ran}"
            e.state_set(user, 0, state, n_pos, keep)
        if not all(e.describe().batch_invariant for e in case.engines):
            # what the worker says too (prefix_cache_off): a restore prefills the rest in other batches than
            # the cold run, and such an engine's rows depend on that
            raise Unsupported("the engine's results depend on the batch (fast kernels, or a GPU lane)")
        r = _chain(case.engines, user, keep, case.prompt[keep:], "all")
        bad = _first_differing(r.logits, case.base_prefill[keep:])
        if bad is not None:
            return f"{tag}: prefill row {keep + bad} differs"
        why = case.decode(user, 0)
        return f"{tag}: {why}" if why else ""


def prefix_cache(case: Case) -> str:
    return "; ".join(w for w in (_restore(case, case.keep, case.keep, "restore"),
                                 _restore(case, case.ran, case.keep, "cut back")) if w)


def rollback(case: Case) -> str:
    """A verification step [t0, t1, wrong, t3] (t0, t1 accepted), every stage truncated to drop the last two,
    then decoding on from t2; rows after t0 and t1, and every later row, equal the cold run's."""
    n, toks = len(case.prompt), case.tokens
    wrong = next(t for t in range(256) if t != toks[2])
    with case.session("spec") as sid:
        _chain(case.engines, sid, 0, case.prompt, "none")
        r = _chain(case.engines, sid, n, [toks[0], toks[1], wrong, toks[3]], "all")
        for e in case.engines:
            e.truncate(sid, 0, n + 2)           # an engine that cannot roll back refuses here, by name
        bad = _first_differing(r.logits[:2], case.base_decode[:2])
        if bad is not None:
            return f"verification row {bad} differs"
        return case.decode(sid, 2)


FEATURES: dict[str, Callable[[Case], str]] = {"prefix cache": prefix_cache, "rollback": rollback}


def run_features(arch: str, workdir: Path, *, lib: str | Path | None = None, n_threads: int = 1,
                 features: tuple[str, ...] = tuple(FEATURES), kernels: str = "reference") -> dict[str, FeatureResult]:
    """Every feature in `features` on `arch` split in three, on the `kernels` set: feature -> result."""
    case = Case.synth(arch, workdir, lib, n_threads, kernels)
    try:
        return check_features(case, arch, features)
    finally:
        case.close()


def check_features(case: Case, arch: str, features: tuple[str, ...] = tuple(FEATURES)) -> dict[str, FeatureResult]:
    """Each feature on `case`'s engines: feature -> result."""
    out: dict[str, FeatureResult] = {}
    for name in features:
        t = time.perf_counter()
        try:
            why = FEATURES[name](case)
            verdict = "exact" if not why else f"DIFFERS ({why})"
        except Unsupported as e:           # by design, by name; any other engine error is a failure
            verdict = f"refused: {refusal(arch, str(e))}"
        out[name] = FeatureResult(arch, name, verdict, time.perf_counter() - t)
    return out


def refusal(arch: str, message: str) -> str:
    """The engine's refusal without the model's path or name: the docs table's words. A worker's Describe
    (`prefix_cache_off`) says `<arch> is a <the same words>`."""
    text = message.split(": ", 1)[1] if message.startswith("/") and ": " in message else message
    text = text.removeprefix(f"{arch} is a ")
    if "cannot drop positions" in text and "only the latest state is kept" in text:
        text = "recurrent or hybrid model: only the latest state is kept"     # without this run's positions
    return text.replace("|", "/").strip()
