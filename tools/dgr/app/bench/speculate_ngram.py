"""`dgr bench --speculate ngram`: what speculation over the ring gains, measured side by side in one run.

Two built-in workloads run on one route of SmolLM2 worker processes, each with and without n-gram
drafts, alternating round by round so that both see the same machine load: a repetitive one (code the
model is asked to restate with one change: its output copies its prompt, so prompt lookup drafts well)
and a plain one (free text: drafts seldom match, so speculation must cost almost nothing there). The
figures: tokens per ring of the repetitive workload with speculation, the plain workload's time per
output token with speculation over without (TPOT ratio), and whether every speculative text equals its
non-speculative run token for token (greedy).
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

from dgr.app.demo import ensure_bundle
from dgr.app.local import LocalRoute, engine_library
from dgr.core.log import get_logger
from dgr.runtime.wire.client import RouteClient
from dgr.runtime.wire.stats import decode_events, draft_stats, rings, tokens_per_ring

log = get_logger(__name__)

CODE = '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
'''
# the repetitive workload: a chat turn asking to restate code with one change (the answer copies it)
REPETITIVE = ("<|im_start|>user\nRename the function to rolling_mean and change nothing else. Reply with the "
              f"whole code.\n\n```python\n{CODE}```<|im_end|>\n<|im_start|>assistant\n```python\n")
# the plain workload: free text, nothing in the prompt to copy
PLAIN = "<|im_start|>user\nWrite a short story about a lighthouse keeper.<|im_end|>\n<|im_start|>assistant\n"
WORKLOADS = {"repetitive": REPETITIVE, "plain": PLAIN}


def _bundle_root(bundle, stages: int) -> Path:
    if bundle is None:
        return Path(ensure_bundle(stages)[0].root)
    return Path(getattr(bundle, "root", bundle))


def measure_speculation(*, stages: int = 3, bundle=None, threads: int = 1, k: int = 4, tokens: int = 96,
                        rounds: int = 4, source: str = "ngram") -> dict:
    """Run both workloads `rounds` times each, plain and speculative alternating, on one route of
    `stages` worker processes (`bundle`: a bundle or its directory; default the demo's SmolLM2 bundle).
    Returns the figures (tokens_per_ring, tpot_ratio_plain, the equal-text flags) and the raw numbers."""
    lib = str(engine_library())
    root = _bundle_root(bundle, stages)
    # ggml's CPU threads spin while they wait: workers sharing a machine split its cores between them
    threads = threads if threads > 0 else max(1, (os.cpu_count() or 1) // stages)
    args = [["--bundle", str(root), "--stage", str(i), "--threads", str(threads)] for i in range(stages)]
    runs: dict[str, dict[str, list]] = {w: {"plain": [], "spec": []} for w in WORKLOADS}
    texts: dict[str, dict[str, set]] = {w: {"plain": set(), "spec": set()} for w in WORKLOADS}
    with LocalRoute(args, env={"DGR_ENGINE_LIB": lib}) as route, RouteClient(route.addresses, prefix_cache=False) as client:
        client.run(PLAIN, max_new_tokens=4)                              # warm every worker first
        for r in range(rounds):
            for name, prompt in WORKLOADS.items():
                # ABBA: the order flips every round, so neither mode always runs first after the other
                for mode in (("plain", "spec") if r % 2 == 0 else ("spec", "plain")):
                    gen = client.run(prompt, max_new_tokens=tokens, stop_token_ids=[],
                                     speculate=source if mode == "spec" else None, draft_k=k)
                    drafted, accepted = draft_stats(gen)
                    tpot = 1000.0 / gen.decode_tokens_per_s if gen.decode_tokens_per_s else 0.0
                    ring = statistics.median(e.ring_ns for e in decode_events(gen)) / 1e6
                    runs[name][mode].append({"tpot_ms": tpot, "ring_ms": ring, "tokens": len(gen.token_ids),
                                             "rings": rings(gen),
                                             "tokens_per_ring": tokens_per_ring(gen), "drafted": drafted,
                                             "accepted": accepted})
                    texts[name][mode].add(tuple(gen.token_ids))
                    log.info("bench speculate: round %d/%d %s %s: %.2f ms/token, %.2f tokens/ring", r + 1, rounds,
                             name, mode, tpot, tokens_per_ring(gen))
    med = {w: {m: {key: statistics.median(x[key] for x in v) for key in v[0]} for m, v in d.items()}
           for w, d in runs.items()}
    same = {w: len(t["plain"]) == 1 and t["plain"] == t["spec"] for w, t in texts.items()}
    plain = med["plain"]
    return {
        "stages": stages, "k": k, "source": source, "tokens": tokens, "rounds": rounds, "threads": threads,
        "tokens_per_ring": med["repetitive"]["spec"]["tokens_per_ring"],
        "tpot_ratio_plain": plain["spec"]["tpot_ms"] / plain["plain"]["tpot_ms"] if plain["plain"]["tpot_ms"] else 0.0,
        "tpot_ratio_repetitive": (med["repetitive"]["spec"]["tpot_ms"] / med["repetitive"]["plain"]["tpot_ms"]
                                  if med["repetitive"]["plain"]["tpot_ms"] else 0.0),
        "same_text_repetitive": same["repetitive"], "same_text_plain": same["plain"],
        "same_text": all(same.values()),
        "median": med, "runs": runs,
    }


def table(res: dict) -> str:
    """The figures as text (`dgr bench --speculate`)."""
    m = res["median"]
    lines = [f"{'':24}{'plain ms/tok':>14}{'spec ms/tok':>14}{'tokens/ring':>13}{'drafts acc.':>14}{'same':>6}"]
    for w in ("repetitive", "plain"):
        s = m[w]["spec"]
        lines.append(f"{w:24}{m[w]['plain']['tpot_ms']:14.2f}{s['tpot_ms']:14.2f}{s['tokens_per_ring']:13.2f}"
                     f"{int(s['accepted']):>7}/{int(s['drafted']):<6}{'yes' if res['same_text_' + w] else 'NO':>6}")
    lines.append(f"tokens per ring (repetitive, speculative): {res['tokens_per_ring']:.2f}; TPOT ratio on the plain "
                 f"workload: {res['tpot_ratio_plain']:.3f} ({res['stages']} stages, k={res['k']}, {res['rounds']} "
                 f"rounds of {res['tokens']} tokens, alternating)")
    return "\n".join(lines)


__all__ = ["PLAIN", "REPETITIVE", "WORKLOADS", "measure_speculation", "table"]
