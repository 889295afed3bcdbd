"""`dgr bench --speculate mtp`: MTP drafts against n-gram drafts and none, in one run.

Three DeepSeek V4 models, each a 4-stage bundle built with `bundle.include_mtp = true` (the MTP block on the
last stage), each served by real worker processes, first on loopback, then through emulated links of
`rtt_ms` round trip per hop (dgr.app.bench.wan_link):

- `tiny`: the tiny random-weight V4 as `dgr synth --arch deepseek4` writes it. Its MTP block is random too:
  what it gives is reported, whatever it is (drafts are seldom accepted);
- `agree R`: a synthetic V4 whose MTP drafts agree with the trunk at a known rate R
  (dgr.toolchain.synth.deepseek4_agree: the trunk is a successor table, the MTP block skips a token on the
  (1 - R) share of the cycle positions it marks): what the ring does with good drafts;
- `agree 0`: the same construction with no agreeing position, so no draft is ever accepted: the
  rejected-draft cost, TPOT with MTP over TPOT without (the issue's bound: at most 1.05x).

Each (model, network) runs `rounds` rounds of greedy generations of `tokens` tokens in each mode (none,
ngram, mtp), the order rotating each round so that no mode always runs first. Reported per row: TPOT
(median, ms), tokens per ring trip, drafts accepted / sent (acceptance), and whether every mode gave the
same text (greedy speculation must not change it).
"""

from __future__ import annotations

import contextlib
import statistics
from pathlib import Path

import numpy as np

from dgr.app.bench.wan_link import WanLinks
from dgr.app.local import LocalRoute, engine_library
from dgr.core.errors import WireError
from dgr.core.hashing import file_blake3
from dgr.core.log import get_logger
from dgr.core.paths import workspace
from dgr.runtime.wire.client import RouteClient
from dgr.runtime.wire.stats import draft_stats, rings, tokens_per_ring
from dgr.toolchain.bundle import find_or_build
from dgr.toolchain.synth.deepseek4 import synth_deepseek4
from dgr.toolchain.synth.deepseek4_agree import synth_deepseek4_agreeing

log = get_logger(__name__)

MODES = ("none", "ngram", "mtp")
LAYERS = 6
RANGES = {2: [(0, 3), (3, 6)], 3: [(0, 2), (2, 4), (4, 6)], 4: [(0, 1), (1, 3), (3, 5), (5, 6)]}


def source(root: Path, agree: float | None = None) -> Path:
    """The V4 source GGUF with its MTP block (written once under `root`/sources): the tiny random-weight one
    (`agree` None), or the synthetic one whose drafts agree with its trunk at `agree`."""
    d = root / "sources"
    d.mkdir(parents=True, exist_ok=True)
    path = d / ("v4-tiny.gguf" if agree is None else f"v4-agree{agree:g}.gguf")
    if not path.is_file():
        tmp = path.with_suffix(".tmp")
        if agree is None:
            synth_deepseek4(tmp, layers=LAYERS, hash_layers=3, embd=128, mtp=True)
        else:
            synth_deepseek4_agreeing(tmp, agree=agree, layers=LAYERS)
        tmp.replace(path)
    return path


def mtp_bundle(src: Path, stages: int, root: Path):
    """`src` split into `stages` stages with bundle.include_mtp = true (built once under `root`)."""
    d = root / f"{src.stem}-{stages}"
    recipe = d / "recipe.toml"
    pairs = ", ".join(f"[{a}, {b}]" for a, b in RANGES[stages])
    text = (f'name = "{src.stem}-mtp"\n\n[source]\nuri = "{src}"\nblake3 = "{file_blake3(src)}"\n\n'
            f"[placement]\nstages = [{pairs}]\n\n[bundle]\ninclude_mtp = true\n")
    d.mkdir(parents=True, exist_ok=True)
    if not recipe.is_file() or recipe.read_text() != text:
        recipe.write_text(text)
    # found again in the store by the recipe's blake3, else built there
    return find_or_build(recipe, d / "store")


def _prompt(n: int = 32) -> list[int]:
    return np.random.default_rng(7).integers(3, 250, size=n).tolist()


def _run(client, prompt, tokens: int, mode: str, k: int) -> dict:
    gen = client.run(prompt, max_new_tokens=tokens, stop_token_ids=[], speculate=None if mode == "none" else mode,
                     draft_k=k)
    drafted, accepted = draft_stats(gen)
    return {"tpot_ms": 1000.0 / gen.decode_tokens_per_s if gen.decode_tokens_per_s else 0.0,
            "tokens_per_ring": tokens_per_ring(gen), "rings": rings(gen), "drafted": drafted, "accepted": accepted,
            "ids": tuple(gen.token_ids), "epochs": gen.epochs}


def mode_rows(client, prompt: list[int], *, tokens: int, rounds: int, k: int, modes=MODES, label: str = "") -> dict:
    """`rounds` greedy generations of `tokens` tokens in each of `modes`, the order rotating each round: per
    mode the median TPOT and tokens per trip, the drafts sent and accepted, and whether all texts were equal."""
    client.run(prompt, max_new_tokens=4, stop_token_ids=[])      # links up, caches warm
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(rounds):
        for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
            x = _run(client, prompt, tokens, mode, k)
            runs[mode].append(x)
            log.info("bench mtp: %s round %d/%d, %s: %.2f ms/token, %.2f tokens/ring, %d/%d drafts", label, r + 1,
                     rounds, mode, x["tpot_ms"], x["tokens_per_ring"], x["accepted"], x["drafted"])
    same = len({x["ids"] for v in runs.values() for x in v}) == 1
    out = {}
    for mode, v in runs.items():
        drafted, accepted = sum(x["drafted"] for x in v), sum(x["accepted"] for x in v)
        out[mode] = {"mode": mode, "tpot_ms": statistics.median(x["tpot_ms"] for x in v),
                     "tokens_per_ring": statistics.median(x["tokens_per_ring"] for x in v), "drafted": drafted,
                     "accepted": accepted, "acceptance": accepted / drafted if drafted else 0.0, "same_text": same,
                     "epochs": max(x["epochs"] for x in v)}
    return out


def measure_mtp(*, stages: int = 4, k: int = 4, tokens: int = 64, rounds: int = 3, rtt_ms: float = 20.0,
                agree: float = 0.8, threads: int = 1, root: Path | None = None) -> dict:
    """The table of the module docstring, as a dict: `rows` (one per model, network and mode) and `cost`
    (the rejected-draft cost on `agree 0`, per network)."""
    if stages not in RANGES:
        raise WireError(f"dgr bench --speculate mtp: --stages {stages}: the tiny V4 bundles have 2, 3 or 4 stages")
    if not 0.0 < agree <= 1.0 or rounds < 1 or tokens < 8:
        raise WireError("dgr bench --speculate mtp needs 0 < agree <= 1, rounds >= 1 and tokens >= 8")
    root = root or workspace() / "bench" / "mtp"
    lib = str(engine_library())
    rows: list[dict] = []
    prompt = _prompt()
    models = {"tiny": None, f"agree {agree:g}": agree, "agree 0": 0.0}
    for model, rate in models.items():
        b = mtp_bundle(source(root, rate), stages, root)
        args = [["--bundle", str(b.root), "--stage", str(i), "--threads", str(threads)] for i in range(stages)]
        with contextlib.ExitStack() as stack:
            route = stack.enter_context(LocalRoute(args, env={"DGR_ENGINE_LIB": lib}))
            nets = {"loopback": route.addresses}
            if rtt_ms > 0:
                nets[f"wan {rtt_ms:g} ms"] = stack.enter_context(WanLinks(route.addresses, rtt_ms / 2)).addresses
            for net, addresses in nets.items():
                c = stack.enter_context(RouteClient(addresses, timeout=300, prefix_cache=False))
                got = mode_rows(c, prompt, tokens=tokens, rounds=rounds, k=k, label=f"{model}, {net},")
                rows += [{"model": model, "network": net, **x} for x in got.values()]
    cost = {}
    for net in {r["network"] for r in rows}:
        by = {r["mode"]: r for r in rows if r["model"] == "agree 0" and r["network"] == net}
        cost[net] = {"tpot_ratio": by["mtp"]["tpot_ms"] / by["none"]["tpot_ms"] if by["none"]["tpot_ms"] else 0.0,
                     "accepted": by["mtp"]["accepted"], "drafted": by["mtp"]["drafted"]}
    return {"stages": stages, "k": k, "tokens": tokens, "rounds": rounds, "rtt_ms": rtt_ms, "agree": agree,
            "threads": threads, "rows": rows, "cost": cost, "same_text": all(r["same_text"] for r in rows)}


def table(res: dict) -> str:
    """The figures as text."""
    lines = [f"{'model':10}{'network':14}{'mode':7}{'TPOT ms':>9}{'tok/ring':>10}{'accepted':>14}{'same':>6}"]
    for r in res["rows"]:
        acc = f"{r['accepted']}/{r['drafted']} {100 * r['acceptance']:.0f}%" if r["drafted"] else "-"
        lines.append(f"{r['model']:10}{r['network']:14}{r['mode']:7}{r['tpot_ms']:9.2f}{r['tokens_per_ring']:10.2f}"
                     f"{acc:>14}{'yes' if r['same_text'] else 'NO':>6}")
    for net, c in sorted(res["cost"].items()):
        lines.append(f"rejected-draft cost ({net}, agree 0: {c['accepted']} of {c['drafted']} drafts accepted): "
                     f"TPOT with MTP / without = {c['tpot_ratio']:.3f}")
    lines.append(f"{res['stages']} stages, k={res['k']}, {res['rounds']} rounds of {res['tokens']} greedy tokens per "
                 f"mode, modes rotating, {res['threads']} thread(s) per worker")
    return "\n".join(lines)


__all__ = ["MODES", "measure_mtp", "table"]
