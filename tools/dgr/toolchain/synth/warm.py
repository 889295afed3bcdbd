"""The prefix cache on one architecture: a split that restores a kept prefix equals the whole model run cold.

A worker's prefix cache (docs/worker.md "Prefix cache") saves what a closed session's layers hold
(`Engine.state_get`) and loads it into a later session that begins with the same tokens
(`Engine.state_set`), keeping all of it or a shorter prefix. This runs the same calls on a tiny model of
the architecture split in three (dgr.toolchain.synth.parity's cuts), in this process:

- `restore`: a session prefills the first `KEEP` tokens; a second one loads its state and prefills the rest;
- `cut back`: a session prefills `RAN` tokens; a later one keeps only the first `KEEP` of them (a shorter
  prompt with the same start), past the sliding window and the ubatch;

then both decode greedily, fed the cold run's tokens. Every logits row after the restored prefix must be
bit-identical to the whole model's cold run. An engine that cannot keep a prefix refuses by name: the
cell says so (`refused: ...`), as the worker's Describe does (`prefix_cache_off`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dgr.core.errors import EngineError
from dgr.toolchain.parity import Schedule, ctx_for, open_stages, run_baseline
from dgr.runtime.engine_api import Step

KEEP = 24        # the restored prefix: three sliding windows of the tiny models (8), more than a ubatch (16)
RAN = 48         # what the cut-back case's first session ran
PROMPT = 70      # the prompt both cases complete
STEPS = 4
_OWN = {"deepseek4": (150, 64, 64, 100)}     # its compressors need longer prompts: (prompt, keep, ubatch, ran)


@dataclass
class WarmResult:
    arch: str
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


def _rows_differ(got: np.ndarray, want: np.ndarray) -> bool:
    return got.shape != want.shape or not np.array_equal(got.view(np.uint32), want.view(np.uint32))


def _warm_case(engines, prompt, forced, base_pre, base_dec, ran: int, keep: int, tag: str) -> str:
    """'' when the warm run equals the cold one, else what differed."""
    saver, user = f"{tag}-saver", f"{tag}-user"
    for e in engines:
        e.open_session(saver, 0)
    try:
        _chain(engines, saver, 0, prompt[:ran], "none")
        states = [e.state_get(saver, 0) for e in engines]
    finally:
        for e in engines:
            e.close_session(saver, 0)
    for e in engines:
        e.open_session(user, 0)
    try:
        for e, (state, n_pos) in zip(engines, states):
            if n_pos != ran:
                return f"{tag}: a stage saved {n_pos} positions, the session ran {ran}"
            e.state_set(user, 0, state, n_pos, keep)
        r = _chain(engines, user, keep, prompt[keep:], "all")
        if _rows_differ(r.logits, base_pre[keep:]):
            bad = next(k for k in range(len(r.logits)) if _rows_differ(r.logits[k], base_pre[keep + k]))
            return f"{tag}: prefill row {keep + bad} differs"
        for t, tok in enumerate(forced):
            r = _chain(engines, user, len(prompt) + t, [tok], "last")
            if _rows_differ(r.logits[0], base_dec[t]):
                return f"{tag}: decode step {t} differs"
    finally:
        for e in engines:
            e.close_session(user, 0)
    return ""


def run_warm_parity(arch: str, workdir: Path, *, lib: str | Path | None = None, n_threads: int = 1) -> WarmResult:
    """Restore and cut back a kept prefix on `arch` split in three; compare with the whole model cold."""
    from dgr.toolchain.synth.generic import layer_kinds
    from dgr.toolchain.synth.parity import EMBD, N_UBATCH, choose_ranges, model_layers, synth_model

    t0 = time.perf_counter()
    n_prompt, keep, n_ubatch, ran = _OWN.get(arch, (PROMPT, KEEP, N_UBATCH, RAN))
    layers = model_layers(arch)
    ranges = choose_ranges(layer_kinds(arch, layers, EMBD), 3)
    model = synth_model(arch, Path(workdir) / f"{arch}-{layers}L-warm.gguf", layers=layers)
    prompt = np.random.default_rng(11).integers(0, 256, size=n_prompt).tolist()
    sched = Schedule(prompts=[prompt], steps=STEPS, n_ubatch=n_ubatch)
    base = run_baseline(model, sched, lib, n_threads)
    forced = base.generated[0][:STEPS]
    engines = open_stages([model] * 3, n_ubatch=n_ubatch, n_ctx=ctx_for([prompt], STEPS), max_sessions=2,
                          ranges=ranges, lib=lib, n_threads=n_threads)
    try:
        why = []
        for tag, r, k in (("restore", keep, keep), ("cut back", ran, keep)):
            try:
                why.append(_warm_case(engines, prompt, forced, base.prefill_logits[0], base.decode_logits[0], r, k, tag))
            except EngineError as e:
                return WarmResult(arch, f"refused: {refusal(arch, str(e))}", time.perf_counter() - t0)
    finally:
        for e in engines:
            e.close()
    bad = [w for w in why if w]
    return WarmResult(arch, "exact" if not bad else f"DIFFERS ({'; '.join(bad)})", time.perf_counter() - t0)


def refusal(arch: str, message: str) -> str:
    """The engine's refusal without the model's path or name: the docs table's words. A worker's Describe
    (`prefix_cache_off`) says `<arch> is a <the same words>`."""
    text = message.split(": ", 1)[1] if message.startswith("/") and ": " in message else message
    text = text.removeprefix(f"{arch} is a ")
    return text.replace("|", "/").strip()
