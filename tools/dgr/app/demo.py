"""`dgr demo`: SmolLM2 split over local worker processes, checked token for token against the whole model.

Sets up what is missing (pinned upstream + engine build, the SmolLM2 source and its N-stage bundle),
starts one `dgr worker serve` process per stage on loopback, generates greedily through the ring, runs
the unsplit GGUF on the same engine in this process, and prints both texts, whether they match token for
token (and logits), tokens/s of each, and the per-hop overhead.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dgr.app.local import LocalRoute
from dgr.core.errors import WireError
from dgr.core.log import get_logger
from dgr.core.paths import REPO_ROOT, workspace
from dgr.runtime.engine import Engine
from dgr.runtime.engine_api import Step
from dgr.runtime.wire.client import RouteClient
from dgr.runtime.wire.stats import hop_overhead_ms, summarize
from dgr.toolchain.bundle import build, load_bundle
from dgr.toolchain.enginebuild import ensure_engine
from dgr.toolchain.recipe import load_recipe
from dgr.toolchain.source import resolve

log = get_logger(__name__)


@dataclass
class WholeRun:
    token_ids: list[int]
    logits: list[np.ndarray]
    prefill_tokens_per_s: float
    decode_tokens_per_s: float


def whole_model_run(engine, ids: list[int], max_new: int, stop_ids: tuple[int, ...] = (),
                    session: str = "whole", chunk_tokens: int = 0) -> WholeRun:
    """Greedy generation on one engine holding every layer: the independent baseline. `chunk_tokens`
    prefills in chunks of that size (as a route does), 0 in one step."""
    engine.open_session(session, 1)
    try:
        t0 = time.perf_counter()
        step = chunk_tokens or len(ids)
        for lo in range(0, len(ids), step):
            hi = min(len(ids), lo + step)
            r = engine.forward([Step(session, 1, np.arange(lo, hi, dtype=np.int32),
                                     np.asarray(ids[lo:hi], np.int32), want_logits="last")])[0]
        t1 = time.perf_counter()
        out, rows, pos = [], [], len(ids)
        while True:
            row = r.logits[-1].copy()
            rows.append(row)
            tok = int(np.argmax(row))
            out.append(tok)
            if len(out) >= max_new or tok in stop_ids:
                break
            r = engine.forward([Step(session, 1, np.array([pos], np.int32), np.array([tok], np.int32),
                                     want_logits="last")])[0]
            pos += 1
        t2 = time.perf_counter()
    finally:
        engine.close_session(session, 1)
    return WholeRun(out, rows, len(ids) / (t1 - t0), (len(out) - 1) / (t2 - t1) if len(out) > 1 else 0.0)


def ensure_bundle(stages: int, *, progress: bool = True):
    """The SmolLM2 bundle of `recipes/smollm2-135m-<N>stage`, built into the workspace store if missing."""
    recipe_dir = REPO_ROOT / "recipes" / f"smollm2-135m-{stages}stage"
    if not recipe_dir.exists():
        raise WireError(f"no recipe {recipe_dir}: the demo has SmolLM2 recipes for 2, 3 and 4 stages")
    recipe = load_recipe(recipe_dir / "recipe.toml")
    store = Path(os.environ.get("DGR_STORE") or workspace() / "store")
    for manifest in sorted(store.glob(f"{recipe.recipe.name}-*/manifest.json")):
        try:
            b = load_bundle(manifest.parent)
        except Exception:
            continue
        if b.manifest.recipe.blake3 == recipe.blake3:
            return b, recipe
    if progress:
        log.info("demo: building bundle %s into %s", recipe.recipe.name, store)
    return build(recipe_dir / "recipe.toml", store, progress=progress), recipe


def source_gguf(recipe) -> Path:
    src = recipe.recipe.source
    return resolve(src.uri, src.blake3, base_dir=recipe.path.parent, progress=False)


def long_prompt(tokenize, n: int) -> list[int]:
    """About `n` tokens of plain text (for prefill throughput)."""
    text = ("In a distributed pipeline each machine owns a contiguous range of layers and passes the "
            "residual stream on to the next one. ")
    reps, ids = 1, tokenize(text)
    while len(ids) < n:
        reps *= 2
        ids = tokenize(text * reps)
    return ids[:n]


def run_demo(*, stages: int = 3, max_tokens: int = 32, prompt: str = "The capital of France is",
             prefill_tokens: int = 256, threads: int = 0) -> int:
    lib = ensure_engine("cpu")
    os.environ["DGR_ENGINE_LIB"] = str(lib)
    bundle, recipe = ensure_bundle(stages)
    # ggml's CPU threads spin while they wait: workers sharing a machine split its cores between them
    threads = threads or max(1, (os.cpu_count() or 1) // stages)
    log.info("demo: bundle %s (%d stages), engine %s, %d compute thread(s) per dgr-worker",
             bundle.root.name, stages, lib, threads)
    args = [["--bundle", str(bundle.root), "--stage", str(i), "--threads", str(threads)]
            for i in range(stages)]
    with LocalRoute(args, env={"DGR_ENGINE_LIB": str(lib)}) as route, RouteClient(route.addresses, prefix_cache=False) as client:
        log.info("demo: %d workers on %s", stages, route.route)
        print(f"\n{prompt}", end="", flush=True)
        for ev in client.generate(prompt, max_new_tokens=max_tokens, logits="last"):
            print(ev.text, end="", flush=True)
        print("\n")
        gen = client.last
        eos = tuple(client.hops[-1].eos_token_ids)
        long_ids = long_prompt(client.tokenize, prefill_tokens) if prefill_tokens else []
        if long_ids:
            long_gen = client.run(long_ids, max_new_tokens=1)
    whole_engine = Engine.open(source_gguf(recipe), lib=lib, n_threads=threads)   # same compute per process
    try:
        whole = whole_model_run(whole_engine, gen.prompt_ids, max_tokens, eos, chunk_tokens=gen.chunk_tokens)
        long_whole = whole_model_run(whole_engine, long_ids, 1, chunk_tokens=long_gen.chunk_tokens) \
            if long_ids else None
    finally:
        whole_engine.close()
    same = whole.token_ids == gen.token_ids
    rows = [gen.logits.get(len(gen.prompt_ids) - 1 + k) for k in range(len(gen.token_ids))]
    diff = max((float(np.max(np.abs(a - b))) for a, b in zip(rows, whole.logits) if a is not None), default=0.0)
    print(f"matches the whole model token for token: {'yes' if same else 'NO'} "
          f"({len(gen.token_ids)} tokens; max |logit diff| {diff:.3g})")
    print(f"pipeline ({stages} stages): prefill {gen.prefill_tokens_per_s:.1f} tok/s, decode "
          f"{gen.decode_tokens_per_s:.1f} tok/s; per-hop overhead {hop_overhead_ms(gen, stages):.2f} ms")
    print(f"whole model:        prefill {whole.prefill_tokens_per_s:.1f} tok/s, decode "
          f"{whole.decode_tokens_per_s:.1f} tok/s")
    log.info("demo: per stage, median ms over decode tokens:\n%s", summarize(gen, stages).split("\n", 1)[-1])
    if long_ids:
        print(f"prefill of a {len(long_ids)}-token prompt: pipeline {long_gen.prefill_tokens_per_s:.1f} tok/s, "
              f"whole model {long_whole.prefill_tokens_per_s:.1f} tok/s"
              f"{'' if long_gen.token_ids == long_whole.token_ids else ' (next token DIFFERS)'}")
    return 0 if same else 1
