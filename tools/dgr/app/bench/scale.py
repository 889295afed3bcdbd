"""`dgr bench scale`: the cost curve of splitting one model into 1, 2, 4, 8 ... stages.

One model, one machine, one run: for each stage count S the model is built into a bundle of S stages
(`choose_ranges`: even cuts, moved to a change of layer kind where the architecture has several), served
by S `dgr worker serve` processes on loopback (`LocalRoute`, one thread each by default) and generates
`tokens` tokens greedily from the same prompt. Measured per S: TPOT (the median decode token's trip round
the ring, the origin's `ring_ns`), the per-hop overhead (ring time minus summed compute, per boundary:
`pipeline.hop_figures`), the loopback floor right after it (`loopback_floor.one_way_ms`, after an idle gap
of that ring time), and the resident memory of every worker (VmRSS, VmHWM) beside the weight bytes its stage
holds (the manifest's `weight_bytes`, and its layers' share of the model). Computed, not measured: the
boundary bytes one token carries across one hop for this model and for DeepSeek V4's width (4 streams x 4096,
f32 and q8_0).

The greedy tokens must be the same for every S (a split never changes what the model computes);
`same_tokens` says whether they were.

The long-context lane (`--long-context N`, 32768 in docs/bench.md): one N-token prompt prefilled by the whole
model (one stage) and by a `--long-stages`-stage route (4 by default), each stage pipelining the prompt's chunks
(`--chunk-tokens`) into the next while it computes the following one. Measured: TTFT of both and their ratio,
the rows of logits both return (the prompt's last position and every generated token) compared bit for bit,
the greedy tokens after the prompt, and each stage's RSS and KV beside its weights.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dgr.app.bench.loopback_floor import MESSAGES_PER_ROUND as FLOOR_MESSAGES, one_way_ms
from dgr.app.bench.pipeline import PROMPT, hop_figures, rounded
from dgr.app.bench.soak import proc_memory
from dgr.app.demo import source_gguf
from dgr.app.local import LocalRoute, engine_library
from dgr.core.contract import WIRE_DTYPES
from dgr.core.errors import DgrError
from dgr.core.hashing import file_blake3
from dgr.core.log import get_logger
from dgr.core.paths import REPO_ROOT
from dgr.gguf.model import model_info
from dgr.runtime.engine_abi import EXACT_KERNELS
from dgr.runtime.wire.client import RouteClient
from dgr.runtime.wire.stats import decode_events
from dgr.toolchain.bundle import build
from dgr.toolchain.recipe import load_recipe
from dgr.toolchain.synth.generic import layer_kinds
from dgr.toolchain.synth.parity import EMBD, check_arch, choose_ranges, model_layers, synth_model
from dgr.toolchain.synth.shapes import synth_shape as write_shape

log = get_logger(__name__)

STAGE_COUNTS = (1, 2, 4, 8)
# DeepSeek V4's boundary: mHC carries hc_mult = 4 residual streams of width 4096 across every seam
V4_STREAMS, V4_EMBD = 4, 4096
MIB = 2**20
LONG_TOKENS = 4                          # greedy tokens after the long-context lane's prompt
LONG_REPLY_S = 3600.0                    # a 32k prompt's first token can take minutes on one thread


@dataclass
class Model:
    """What `dgr bench scale` splits: a GGUF, what to call it, and the layer kinds cuts prefer."""

    path: Path
    label: str
    kinds: list[str]                    # one per main layer
    synthetic: bool                     # random weights: the prompt is random token ids
    blake3: str = ""                     # the source's hash, for the recipes (computed once)


def model_of(*, source: str | None, synth: str | None, synth_shape: str | None, max_stages: int,
             workdir: Path, context: int | None = None) -> Model:
    """The model of `--source`, `--synth ARCH` (tiny, at least `max_stages` layers, declaring `context` positions
    when given) or `--synth-shape NAME` (written into `workdir`); without any, the embedded SmolLM2's source
    GGUF."""
    if sum(x is not None for x in (source, synth, synth_shape)) > 1:
        raise DgrError("dgr bench scale: give one of --source, --synth and --synth-shape")
    if synth:
        check_arch(synth)
        layers = max(model_layers(synth), max_stages)
        path = synth_model(synth, workdir / f"{synth}-{layers}L.gguf", layers=layers, context=context)
        return Model(path, f"synthetic {synth}", layer_kinds(synth, layers, EMBD), True)
    if synth_shape:
        log.info("bench scale: writing the %s shape (random Q4_K_M weights, several GB) into %s", synth_shape, workdir)
        path = write_shape(synth_shape, workdir / f"{synth_shape}.gguf")
        info = model_info(path)
        return Model(path, f"synthetic shape {synth_shape}", ["layer"] * info.n_layer, True)
    if source:
        path = Path(source).expanduser().resolve()
        if not path.is_file():
            raise DgrError(f"dgr bench scale --source {source}: no such file; give a GGUF model")
        label = path.name
    else:
        path = source_gguf(load_recipe(REPO_ROOT / "recipes" / "smollm2-135m-2stage" / "recipe.toml"))
        label = "smollm2-135m"
    return Model(path, label, ["layer"] * model_info(path).n_layer, False)


def bundle_of(model: Model, stages: int, workdir: Path):
    """`model` split into `stages` stages (a fresh bundle under `workdir`), with the source's tensor types."""
    ranges = choose_ranges(model.kinds, stages)
    work = workdir / f"s{stages}"
    work.mkdir(parents=True, exist_ok=True)
    pairs = ", ".join(f"[{a}, {b}]" for a, b in ranges)
    recipe = work / "recipe.toml"
    recipe.write_text(f'name = "bench-scale-{stages}"\n\n[source]\nuri = "{model.path}"\n'
                      f'blake3 = "{model.blake3}"\n\n[quantization]\ndefault = "keep"\n\n'
                      f"[placement]\nstages = [{pairs}]\n")
    return build(recipe, work / "store", progress=False)


def boundary_bytes(n_values: int) -> dict[str, int]:
    """Bytes one token's boundary of `n_values` values takes on the wire, per dtype that packs it (WIRE_DTYPES)."""
    return {name: d.nbytes(n_values) for name, d in WIRE_DTYPES.items() if d.fits(n_values)}


def _med(xs) -> float:
    xs = list(xs)
    return float(statistics.median(xs)) if xs else 0.0


def _stage_memory(bundle, layer_bytes: list[int], mem: list[dict], engine_mem: list[dict]) -> list[dict]:
    """Per stage of `bundle`: its worker's RSS and VmHWM (`mem`, /proc), what its engine allocated (`engine_mem`,
    the descriptor's memory report), its weights and its layers' share of the model."""
    rows = []
    for st, m, em in zip(bundle.manifest.stages, mem, engine_mem):
        rss = m.get("VmRSS", 0) * 1024
        kv = int(em.get("kv_bytes", 0))
        rows.append({"stage": st.index, "layers": [st.layer_begin, st.layer_end],
                     "rss_bytes": rss, "hwm_bytes": m.get("VmHWM", 0) * 1024,
                     "weight_bytes": st.weight_bytes, "layer_bytes": sum(layer_bytes[st.layer_begin:st.layer_end]),
                     "rss_minus_weights_bytes": rss - st.weight_bytes,
                     "kv_bytes": kv, "compute_bytes": int(em.get("compute_bytes", 0)),
                     # the bound: RSS <= (weights + KV) x 1.15
                     "rss_over_weights_and_kv": rss / (st.weight_bytes + kv) if st.weight_bytes + kv else 0.0})
    return rows


def _measure(bundle, layer_bytes: list[int], *, tokens: int, threads: int, lib: Path, prompt_ids: list[int] | None,
             n_ctx: int, kernels: str) -> dict:
    """One stage count: serve `bundle`, generate, and read the figures (see the module docstring)."""
    S = len(bundle.manifest.stages)
    args = [["--bundle", str(bundle.root), "--stage", str(i), "--threads", str(threads), "--n-ctx", str(n_ctx),
             "--kernels", kernels] for i in range(S)]
    with LocalRoute(args, env={"DGR_ENGINE_LIB": str(lib)}, timeout=600) as route, \
            RouteClient(route.addresses, prefix_cache=False) as c:
        if prompt_ids is None:
            prompt_ids = c.tokenize(PROMPT)
        c.run(prompt_ids, max_new_tokens=4, stop_token_ids=[])          # warm-up: pages in, threads started
        g = c.run(prompt_ids, max_new_tokens=tokens, stop_token_ids=[])
        mem = [proc_memory(p.pid) for p in route.procs]                  # dgr worker serve execs dgr-worker: same pid
        # what each engine allocated: KV (and per-layer state) for --n-ctx x --max-sessions, compute buffers
        engine_mem = [json.loads(d.descriptor_json)["capacity"]["memory"] for d in c.hops]
        hop = hop_figures([g], S)
        ring = [e.ring_ns / 1e6 for e in decode_events(g)]
        floor = one_way_ms(_med(ring), FLOOR_MESSAGES)
    per_stage = _stage_memory(bundle, layer_bytes, mem, engine_mem)
    biggest = max(per_stage, key=lambda r: r["rss_bytes"])
    return {
        "stages": S, "ranges": [s["layers"] for s in per_stage], "bundle_id": bundle.id,
        "token_ids": g.token_ids,
        "tpot_ms": _med(ring), "tpot_mean_ms": 1e3 / g.decode_tokens_per_s if g.decode_tokens_per_s else 0.0,
        "decode_tok_s": g.decode_tokens_per_s, "compute_ms": hop["compute_ms"],
        "per_hop_ms": hop["per_hop_ms"], "per_hop_p90_ms": hop["per_hop_p90_ms"],
        "floor_one_way_ms": floor["one_way_ms"], "floor_gap_ms": floor["gap_ms"],
        "per_hop_over_floor": hop["per_hop_ms"] / floor["one_way_ms"] if floor["one_way_ms"] else 0.0,
        "decode_tokens_timed": hop["tokens"],
        "max_rss_bytes": biggest["rss_bytes"], "max_rss_stage": biggest["stage"],
        "max_weight_bytes": max(r["weight_bytes"] for r in per_stage),
        "max_rss_over_weights_and_kv": max(r["rss_over_weights_and_kv"] for r in per_stage),
        "total_rss_bytes": sum(r["rss_bytes"] for r in per_stage),
        "total_weight_bytes": sum(r["weight_bytes"] for r in per_stage),
        "per_stage": per_stage,
    }


def _long_run(bundle, layer_bytes: list[int], *, prompt_ids: list[int], tokens: int, threads: int, lib: Path,
              chunk_tokens: int, kernels: str) -> dict:
    """One side of the long-context lane: `bundle` served (one process per stage, room for one session of the
    whole prompt), the prompt prefilled once, `tokens` greedy tokens, the logits rows and memory read."""
    S = len(bundle.manifest.stages)
    n_ctx = len(prompt_ids) + tokens + 16
    args = [["--bundle", str(bundle.root), "--stage", str(i), "--threads", str(threads), "--n-ctx", str(n_ctx),
             "--max-sessions", "1", "--kernels", kernels] for i in range(S)]
    with LocalRoute(args, env={"DGR_ENGINE_LIB": str(lib)}, timeout=600) as route, \
            RouteClient(route.addresses, prefix_cache=False, chunk_tokens=chunk_tokens, timeout=LONG_REPLY_S) as c:
        c.run(prompt_ids[:8], max_new_tokens=1, stop_token_ids=[])            # warm-up: pages the weights in
        g = c.run(prompt_ids, max_new_tokens=tokens, stop_token_ids=[], logits="last")
        mem = [proc_memory(p.pid) for p in route.procs]
        engine_mem = [json.loads(d.descriptor_json)["capacity"]["memory"] for d in c.hops]
    per_stage = _stage_memory(bundle, layer_bytes, mem, engine_mem)
    return {"stages": S, "ttft_s": g.t_first - g.t_start, "prefill_tok_s": g.prefill_tokens_per_s,
            "chunk_tokens": g.chunk_tokens, "token_ids": g.token_ids, "logits": g.logits,
            "max_rss_bytes": max(r["rss_bytes"] for r in per_stage), "per_stage": per_stage}


def check_long_context(model: Model, info, *, prompt_tokens: int, stages: int, tokens: int) -> None:
    """Refuse, before anything runs, a long-context lane `model` has no room or no layers for."""
    trained = int(info.header.get(f"{info.arch}.context_length", 0) or 0)
    if prompt_tokens + tokens > trained:
        raise DgrError(f"dgr bench scale --long-context {prompt_tokens}: {model.label} was trained for "
                       f"{trained} positions; give a model with room for {prompt_tokens + tokens} (`--synth "
                       "ARCH` is written with room for it; `--synth-shape qwen2-7b` has 32768)")
    if stages > len(model.kinds):
        raise DgrError(f"dgr bench scale --long-stages {stages}: {model.label} has {len(model.kinds)} layers")


def long_context(model: Model, info, *, prompt_tokens: int, stages: int, tokens: int, threads: int, lib: Path,
                 chunk_tokens: int, workdir: Path, kernels: str = "invariant") -> dict:
    """The long-context lane (the module docstring): the whole model, then `stages` stages, on one prompt."""
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, 256, size=prompt_tokens).tolist()     # byte-level ids every vocabulary here has
    sides = []
    for S in (1, stages):
        log.info("bench scale: long context: a %d-token prompt on %d stage(s), chunks of %d tokens",
                 prompt_tokens, S, chunk_tokens)
        bundle = bundle_of(model, S, workdir / "long")
        sides.append(_long_run(bundle, info.layer_bytes(), prompt_ids=prompt, tokens=tokens, threads=threads,
                               lib=lib, chunk_tokens=chunk_tokens, kernels=kernels))
        log.info("bench scale: long context, %d stage(s): TTFT %.2f s, max RSS %.1f MiB", S, sides[-1]["ttft_s"],
                 sides[-1]["max_rss_bytes"] / MIB)
        shutil.rmtree(bundle.root.parent.parent, ignore_errors=True)
    whole, split = sides
    rows = sorted(set(whole["logits"]) & set(split["logits"]))
    diffs = [float(np.max(np.abs(whole["logits"][p] - split["logits"][p]))) for p in rows]
    exact = bool(rows) and all(np.array_equal(whole["logits"][p], split["logits"][p]) for p in rows)
    for side in sides:
        side["logits_rows"] = sorted(side.pop("logits"))
    return {"prompt_tokens": prompt_tokens, "tokens": tokens, "stages": stages, "chunk_tokens": chunk_tokens,
            "kernels": kernels, "whole": whole, "split": split,
            "ttft_ratio": split["ttft_s"] / whole["ttft_s"] if whole["ttft_s"] else 0.0,
            "rows_compared": rows, "logits_exact": exact, "logits_max_abs_diff": max(diffs, default=0.0),
            "same_tokens": whole["token_ids"] == split["token_ids"]}


def _slope(xs: list[float], ys: list[float]) -> float:
    """The least-squares slope of ys over xs (0 with fewer than two points)."""
    return float(np.polyfit(xs, ys, 1)[0]) if len(set(xs)) > 1 else 0.0


def run_scale(*, stages=STAGE_COUNTS, tokens: int = 32, threads: int = 1, source: str | None = None,
              synth: str | None = None, synth_shape: str | None = None, lib: str | None = None,
              keep: bool = False, long_context_tokens: int = 0, long_stages: int = 4,
              long_chunk_tokens: int = 512, kernels: str = "invariant") -> dict:
    """Measure the cost curve (the module docstring), and the long-context lane when `long_context_tokens`;
    progress goes to the log (stderr), the report is a dict."""
    counts = sorted(set(int(s) for s in stages))
    if not counts or counts[0] < 1 or tokens < 2 or threads < 1:
        raise DgrError("dgr bench scale: --stages must be positive counts, --tokens at least 2, --threads at least 1")
    if kernels not in EXACT_KERNELS:
        raise DgrError(f"dgr bench scale: --kernels {kernels}: choose an exact set, one of {', '.join(EXACT_KERNELS)} "
                       "(a split compared with the whole model must compute alike)")
    if long_context_tokens < 0 or (long_context_tokens and (long_stages < 2 or long_chunk_tokens < 1)):
        raise DgrError("dgr bench scale: --long-context must be a token count, --long-stages at least 2, "
                       "--chunk-tokens at least 1")
    lib_path = engine_library(lib)
    work = Path(tempfile.mkdtemp(prefix="dgr-bench-scale-"))
    if keep:
        log.info("bench scale: the model and bundles go to %s (kept)", work)
    t0 = time.perf_counter()
    try:
        model = model_of(source=source, synth=synth, synth_shape=synth_shape,
                         max_stages=max(counts[-1], long_stages if long_context_tokens else 0), workdir=work,
                         context=long_context_tokens + tokens + 64 if long_context_tokens else None)
        if counts[-1] > len(model.kinds):
            raise DgrError(f"dgr bench scale: {model.label} has {len(model.kinds)} layers; --stages {counts[-1]} "
                           "needs at least that many")
        model.blake3 = file_blake3(model.path)
        info = model_info(model.path)
        if long_context_tokens:
            check_long_context(model, info, prompt_tokens=long_context_tokens, stages=long_stages, tokens=LONG_TOKENS)
        file_bytes = model.path.stat().st_size
        prompt = np.random.default_rng(3).integers(0, 256, size=6).tolist() if model.synthetic else None
        n_ctx = max(256, tokens + 64)
        runs = []
        for S in counts:
            log.info("bench scale: %d stage(s): building the bundle", S)
            bundle = bundle_of(model, S, work)
            log.info("bench scale: %d stage(s): %d worker process(es), %d thread(s) each, %d tokens",
                     S, S, threads, tokens)
            r = _measure(bundle, info.layer_bytes(), tokens=tokens, threads=threads, lib=lib_path, prompt_ids=prompt,
                         n_ctx=n_ctx, kernels=kernels)
            runs.append(r)
            log.info("bench scale: %d stage(s): TPOT %.2f ms, per hop %.3f ms (floor %.3f ms), max RSS %.1f MiB",
                     S, r["tpot_ms"], r["per_hop_ms"], r["floor_one_way_ms"], r["max_rss_bytes"] / MIB)
            if not keep:
                shutil.rmtree(bundle.root.parent.parent, ignore_errors=True)   # a 7B bundle is gigabytes
        long = (long_context(model, info, prompt_tokens=long_context_tokens, stages=long_stages, tokens=LONG_TOKENS,
                             threads=threads, lib=lib_path, chunk_tokens=long_chunk_tokens, workdir=work,
                             kernels=kernels)
                if long_context_tokens else None)
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    rep = _report(model, info, file_bytes, runs, tokens, threads, lib_path, time.perf_counter() - t0)
    rep["bench"]["kernels"] = kernels
    if long is not None:
        rep["long_context"] = long
        del rep["left_out"]
    return rounded(rep)


def _report(model: Model, info, file_bytes: int, runs: list[dict], tokens: int, threads: int, lib: Path,
            seconds: float) -> dict:
    base = runs[0]
    total = sum(t.nbytes for t in info.header.tensors)          # every tensor of the source, once
    for r in runs:
        # the point of splitting: memory per host falls as 1/S (the whole model's weights over S)
        r["model_weights_over_s_bytes"] = total / r["stages"]
        r["slope_ms_per_stage"] = ((r["tpot_ms"] - base["tpot_ms"]) / (r["stages"] - base["stages"])
                                   if r["stages"] != base["stages"] else 0.0)
    ids = [r["token_ids"] for r in runs]
    layer_total = sum(info.layer_bytes())
    width = info.n_embd * info.n_streams
    return {
        "bench": {"model": model.label, "path": str(model.path), "arch": info.arch, "n_layer": info.n_layer,
                  "n_embd": info.n_embd, "n_streams": info.n_streams, "threads": threads, "tokens": tokens,
                  "engine_lib": str(lib), "worker": "dgr-worker", "cpus": os.cpu_count(),
                  "seconds": round(seconds, 1), "model_file_bytes": file_bytes,
                  "model_layer_bytes": layer_total, "model_weight_bytes": total},
        "runs": runs,
        "tpot_slope_ms_per_stage": _slope([r["stages"] for r in runs], [r["tpot_ms"] for r in runs]),
        "same_tokens": all(x == ids[0] for x in ids),
        # computed from the wire dtype table, not measured: what one token's boundary takes across one hop
        "boundary_bytes_per_token_per_hop": {
            "computed": True,
            "this_model": {"values": width, **boundary_bytes(width)},
            "deepseek_v4": {"values": V4_STREAMS * V4_EMBD, **boundary_bytes(V4_STREAMS * V4_EMBD)},
            "how": "values per token (n_streams x n_embd) packed by dgr.core.contract.WIRE_DTYPES; "
                   "DeepSeek V4: hc_mult 4 streams x 4096",
        },
        "left_out": "the long-context lane: run with --long-context N (e.g. 32768)",
    }


def table(rep: dict) -> str:
    """The report as the lines `dgr bench scale` prints."""
    b = rep["bench"]
    lines = [f"dgr bench scale: {b['model']} ({b['arch']}, {b['n_layer']} layers, width {b['n_embd']}), "
             f"{b['threads']} thread(s) per worker, {b['tokens']} tokens, {b.get('kernels', 'reference')} kernels, "
             f"{b['cpus']} CPU(s), {b['seconds']} s",
             f"  {'stages':>6} {'TPOT ms':>8} {'slope ms/st':>11} {'hop ms':>7} {'floor ms':>8} {'hop/fl':>6} "
             f"{'max RSS MiB':>11} {'its weights':>11} {'RSS-weights':>11} {'model/S MiB':>11} {'RSS/(w+KV)':>10}"]
    for r in rep["runs"]:
        st = max(r["per_stage"], key=lambda s: s["rss_bytes"])
        lines.append(f"  {r['stages']:>6} {r['tpot_ms']:>8.2f} {r['slope_ms_per_stage']:>11.3f} "
                     f"{r['per_hop_ms']:>7.3f} "
                     f"{r['floor_one_way_ms']:>8.3f} {r['per_hop_over_floor']:>5.1f}x {st['rss_bytes'] / MIB:>11.1f} "
                     f"{st['weight_bytes'] / MIB:>11.1f} {st['rss_minus_weights_bytes'] / MIB:>11.1f} "
                     f"{r['model_weights_over_s_bytes'] / MIB:>11.1f} "
                     f"{r.get('max_rss_over_weights_and_kv', 0.0):>9.2f}x")
    lines.append(f"  TPOT slope (least squares over the stage counts): {rep['tpot_slope_ms_per_stage']:.3f} ms per "
                 "added stage")
    lines.append("  per stage, [layers) RSS / weights + KV MiB (the row above is the stage with the most RSS; "
                 "RSS/(w+KV): the most of any stage):")
    for r in rep["runs"]:
        lines.append(f"    {r['stages']} stage(s): " + ", ".join(
            f"[{a},{z}) {s['rss_bytes'] / MIB:.1f}/{s['weight_bytes'] / MIB:.1f}+{s.get('kv_bytes', 0) / MIB:.1f}"
            for s in r["per_stage"] for a, z in [s["layers"]]))
    bb = rep["boundary_bytes_per_token_per_hop"]
    for key, what in (("this_model", "this model"), ("deepseek_v4", "DeepSeek V4 (4 x 4096)")):
        d = bb[key]
        lines.append(f"  boundary per token per hop, {what}, computed: {d['values']} values, "
                     + ", ".join(f"{k} {v} B" for k, v in d.items() if k != "values"))
    lines.append(f"  greedy tokens the same for every stage count: {'yes' if rep['same_tokens'] else 'NO'}")
    lc = rep.get("long_context")
    if lc:
        w, s = lc["whole"], lc["split"]
        lines.append(f"  long context: a {lc['prompt_tokens']}-token prompt, chunks of {lc['chunk_tokens']} tokens: "
                     f"TTFT {w['ttft_s']:.2f} s whole, {s['ttft_s']:.2f} s on {lc['stages']} stages "
                     f"({lc['ttft_ratio']:.2f}x); max RSS per stage {w['max_rss_bytes'] / MIB:.1f} MiB whole, "
                     f"{s['max_rss_bytes'] / MIB:.1f} MiB split")
        lines.append("    per stage, [layers) RSS / weights + KV MiB: " + ", ".join(
            f"[{a},{z}) {st['rss_bytes'] / MIB:.1f}/{st['weight_bytes'] / MIB:.1f}+{st['kv_bytes'] / MIB:.1f}"
            for st in s["per_stage"] for a, z in [st["layers"]]))
        lines.append(f"    logits of {len(lc['rows_compared'])} rows the same bit for bit: "
                     f"{'yes' if lc['logits_exact'] else 'NO (max |diff| %g)' % lc['logits_max_abs_diff']}; "
                     f"greedy tokens the same: {'yes' if lc['same_tokens'] else 'NO'}")
    return "\n".join(lines)


def plot(rep: dict, path: str | Path) -> Path:
    """TPOT and per-hop overhead against the stage count; max RSS per stage against the weights per stage."""
    # lazy: matplotlib costs 88 ms at start-up (python -X importtime, 2026-12-05); only --plot draws
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib.pyplot costs 278 ms at start-up (python -X importtime, 2026-12-05)
    import matplotlib.pyplot as plt

    S = [r["stages"] for r in rep["runs"]]
    fig, (a, m) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(S, [r["tpot_ms"] for r in rep["runs"]], "o-", label="TPOT")
    a.plot(S, [r["compute_ms"] for r in rep["runs"]], "s--", label="summed compute")
    a.set_xlabel("stages")
    a.set_ylabel("ms per decode token")
    h = a.twinx()
    h.plot(S, [r["per_hop_ms"] for r in rep["runs"]], "^:", color="C3", label="per hop")
    h.plot(S, [r["floor_one_way_ms"] for r in rep["runs"]], "v:", color="C4", label="loopback floor")
    h.set_ylabel("ms per hop")
    a.legend(loc="upper left")
    h.legend(loc="lower right")
    m.plot(S, [r["max_rss_bytes"] / MIB for r in rep["runs"]], "o-", label="max RSS per stage")
    m.plot(S, [r["max_weight_bytes"] / MIB for r in rep["runs"]], "s--", label="max weights per stage")
    m.set_xlabel("stages")
    m.set_ylabel("MiB")
    m.legend()
    for ax in (a, m):
        ax.set_xticks(S)
        ax.grid(alpha=0.3)
    fig.suptitle(f"dgr bench scale: {rep['bench']['model']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


__all__ = ["STAGE_COUNTS", "boundary_bytes", "plot", "run_scale", "table"]
