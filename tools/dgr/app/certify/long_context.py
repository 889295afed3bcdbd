"""The gate's long-context lane (`[gate.long_context]` of a contract): `dgr bench scale`'s long-context measurement
(dgr.app.bench.scale.long_context) on a random-weight model the gate writes with room for the prompt, judged.

Rows: the logits both sides return (the prompt's last position and each greedy token after it) the same bit for
bit with the same tokens, which must pass; TTFT of the split against the whole model, and the most resident memory
of any stage against the whole model's, which are reported (a shared host's cores say nothing about the ratio a
split over hosts reaches, and a tiny model's RSS is the worker's own code).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from dgr.app.bench.scale import LONG_TOKENS, MIB, Model, check_long_context, long_context
from dgr.app.certify.contract import LongContext
from dgr.core.certificate import Figure
from dgr.core.hashing import file_blake3
from dgr.gguf.model import model_info
from dgr.toolchain.synth.generic import layer_kinds
from dgr.toolchain.synth.parity import EMBD, synth_model

EXACT_CHECK = "long context: logits whole = split"


def long_context_figures(spec: LongContext, *, lib: Path, threads: int) -> list[Figure]:
    """Write the model, run the lane, and return its figures (the module docstring)."""
    work = Path(tempfile.mkdtemp(prefix="dgr-gate-long-"))
    try:
        path = synth_model(spec.arch, work / f"{spec.arch}-{spec.layers}L.gguf", layers=spec.layers,
                           context=spec.tokens + LONG_TOKENS + 64)
        model = Model(path, f"synthetic {spec.arch}", layer_kinds(spec.arch, spec.layers, EMBD), True,
                      blake3=file_blake3(path))
        info = model_info(path)
        check_long_context(model, info, prompt_tokens=spec.tokens, stages=spec.stages, tokens=LONG_TOKENS)
        r = long_context(model, info, prompt_tokens=spec.tokens, stages=spec.stages, tokens=LONG_TOKENS,
                         threads=threads, lib=lib, chunk_tokens=spec.chunk_tokens, workdir=work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    what = (f"a {spec.tokens}-token prompt on a {spec.arch} model of {spec.layers} layers, whole and on "
            f"{spec.stages} stages, chunks of {spec.chunk_tokens}, {threads} thread(s) per process, "
            f"{r['kernels']} kernels")
    w, s = r["whole"], r["split"]
    exact = r["logits_exact"] and r["same_tokens"]
    return [
        Figure(check=EXACT_CHECK,
               figure=(f"{len(r['rows_compared'])} rows the same" if exact else
                       f"max |diff| {r['logits_max_abs_diff']:g}, tokens {'same' if r['same_tokens'] else 'differ'}"),
               threshold="bit for bit, same tokens", passed=exact,
               detail=f"{what}; rows at positions {r['rows_compared']}"),
        Figure(check="long context: TTFT split / whole", figure=round(r["ttft_ratio"], 3), threshold="reported",
               passed=True, detail=f"{what}; TTFT {w['ttft_s']:.2f} s whole, {s['ttft_s']:.2f} s split"),
        Figure(check="long context: max RSS per stage / whole", figure=round(s["max_rss_bytes"] / w["max_rss_bytes"], 3),
               threshold="reported", passed=True,
               detail=f"{what}; per stage [layers) RSS / weights + KV MiB: " + ", ".join(
                   f"[{st['layers'][0]},{st['layers'][1]}) {st['rss_bytes'] / MIB:.1f}/{st['weight_bytes'] / MIB:.1f}"
                   f"+{st['kv_bytes'] / MIB:.1f}" for st in s["per_stage"])
               + f"; whole {w['max_rss_bytes'] / MIB:.1f} MiB"),
    ]


__all__ = ["EXACT_CHECK", "long_context_figures"]
