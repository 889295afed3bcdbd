"""`dgr bench`'s report drawn: the text table on stdout and the picture (`--plot FILE.png`, matplotlib Agg)."""

from __future__ import annotations

from pathlib import Path

from dgr.core.errors import DgrError


def table(rep: dict) -> str:
    """The report as the lines a person reads: whole vs pipeline, the hops, the stages, bytes, sessions."""
    b, w, p, r, s = rep["bench"], rep["whole"], rep["pipeline"], rep["ratios"], rep["sessions"]
    lines = [f"dgr bench: {b['model']} ({b['arch']}), {b['stages']} stages, {b['threads']} thread(s) per process, "
             f"{b['chunk_tokens']}-token prefill chunks, {b['wire_dtype']} boundary, {b.get('worker', 'dgr-worker')}, "
             f"{b.get('kernels', 'reference')} kernels, "
             f"{b['rounds']} round(s), "
             f"{b['cpus']} CPU(s), {b['seconds']:.0f} s",
             f"  {'':28}{'whole':>10}{'pipeline':>10}{'ratio':>8}"]
    for n, v in w["prefill_tok_s_by_len"].items():
        lines.append(f"  {'prefill tok/s, ' + n + ' tokens':28}{v:10.1f}{p['prefill_tok_s_by_len'][n]:10.1f}"
                     f"{r['prefill_by_len'][n]:7.2f}x")
    lines.append(f"  {'decode tok/s':28}{w['decode_tok_s']:10.1f}{p['decode_tok_s']:10.1f}{r['decode']:7.2f}x")
    lines.append(f"  per-hop overhead (ring - compute, per boundary): median {p['per_hop_ms']:.3f} ms, "
                 f"p90 {p['per_hop_p90_ms']:.3f} ms; ring {p['ring_ms']:.2f} ms/token, compute {p['compute_ms']:.2f} ms")
    for x in p["boundaries"]:
        lines.append(f"    boundary {x['boundary']:<10} median {x['median_ms']:.3f} ms, p90 {x['p90_ms']:.3f} ms")
    lines.append(f"    origin's own handling {p['origin_ms']:.3f} ms per token")
    fl = rep.get("floor")
    if fl and fl.get("one_way_ms"):
        lines.append(f"    loopback floor: one bare TCP message between two processes after {fl['gap_ms']:.1f} ms idle "
                     f"takes {fl['one_way_ms']:.3f} ms one way (p90 {fl['one_way_p90_ms']:.3f}); the per-hop "
                     f"overhead is {fl['per_hop_over_floor']:.1f}x that")
    lines.append("  per stage, median ms per decode token:")
    for x in p["stages"]:
        lines.append(f"    stage {x['stage']}: transit in {x['transit']:.3f}, queue {x['queue']:.3f}, compute "
                     f"{x['compute']:.3f} (p90 {x['compute_p90']:.3f}), encode+send {x['send']:.3f}")
    wb = rep["wire"]
    sock = wb["socket_bytes_per_token"]
    lines.append(f"  wire: {p['wire_bytes_per_token']:.0f} bytes per decode token on the sockets"
                 + (f" (into each stage {', '.join(f'{v:.0f}' for v in sock['into_stage'])})" if sock else
                    " (payload only: ss unavailable)")
                 + f"; boundary payload {wb['payload_bytes_per_token']} bytes per token "
                   f"({' + '.join(str(v) for v in wb['payload_bytes_per_token_per_seam'])})")
    if s["aggregate_tok_s"]:
        lines.append(f"  sessions: {s['m']} concurrent {s['aggregate_tok_s']:.1f} tok/s aggregate, one alone "
                     f"{s['single_tok_s']:.1f} tok/s: {s['aggregate_over_single']:.2f}x")
        if s.get("unbatched_aggregate_tok_s"):
            lines.append(f"  batching (exact): {s['m']} sessions {s['aggregate_tok_s']:.1f} tok/s sharing forwards, "
                         f"{s['unbatched_aggregate_tok_s']:.1f} tok/s with none shared: "
                         f"{s['batched_over_unbatched']:.2f}x")
    inv = rep.get("invariance")
    if inv and inv.get("whole_prefill_fast_kernels_tok_s"):
        lines.append(f"  invariance: prefill of {inv['prefill_len']} (whole model) {inv['whole_prefill_tok_s']:.1f} tok/s "
                     f"with the {b.get('kernels', 'reference')} kernels, {inv['whole_prefill_fast_kernels_tok_s']:.1f} "
                     f"with llama.cpp's fast "
                     f"ones: {inv['reference_over_fast']:.2f}x")
    lines.append(f"  greedy tokens equal the whole model's: {'yes' if p['same_tokens_as_whole'] else 'NO'}")
    return "\n".join(lines)


def plot(rep: dict, path: str | Path) -> Path:
    """Write the PNG: tok/s bars (whole vs pipeline: prefill per length and decode; one session vs M),
    where a decode token's time goes per stage (stacked), and the per-boundary overhead (median, p90)."""
    try:
        # lazy: matplotlib costs 88 ms at start-up (python -X importtime, 2026-12-05); only --plot draws
        import matplotlib
    except ImportError:
        raise DgrError("--plot needs matplotlib: install it into this environment "
                       "(.venv/bin/pip install matplotlib)") from None
    matplotlib.use("Agg")
    # lazy: matplotlib.pyplot costs 278 ms at start-up (python -X importtime, 2026-12-05)
    import matplotlib.pyplot as plt

    b, w, p, s = rep["bench"], rep["whole"], rep["pipeline"], rep["sessions"]
    fig, ax = plt.subplots(2, 2, figsize=(13, 8.5))
    fig.suptitle(f"dgr bench: {b['model']}, {b['stages']} stages, {b['threads']} thread(s) per process, "
                 f"{b.get('worker', 'dgr-worker')}, {b['cpus']} CPU(s)")

    a = ax[0][0]
    labels = [f"prefill {n}" for n in w["prefill_tok_s_by_len"]] + ["decode"]
    wv = list(w["prefill_tok_s_by_len"].values()) + [w["decode_tok_s"]]
    pv = list(p["prefill_tok_s_by_len"].values()) + [p["decode_tok_s"]]
    xs = range(len(labels))
    a.bar([x - 0.2 for x in xs], wv, 0.4, label="whole model (1 process)")
    a.bar([x + 0.2 for x in xs], pv, 0.4, label=f"pipeline ({b['stages']} processes)")
    ratios = list(rep["ratios"]["prefill_by_len"].values()) + [rep["ratios"]["decode"]]
    for x, (v, q) in enumerate(zip(pv, ratios)):
        a.annotate(f"{q:.2f}x", (x + 0.2, v), ha="center", va="bottom", fontsize=8)
    a.set_xticks(list(xs), labels)
    a.set_ylabel("tokens/s")
    a.set_title("whole model vs pipeline (medians; above: pipeline / whole, paired per round)")
    a.set_ylim(0, 1.25 * max(wv + pv + [1.0]))
    a.legend(fontsize=8, loc="upper center", ncol=2)

    a = ax[0][1]
    vals = [s["single_tok_s"], s["aggregate_tok_s"]]
    a.bar(["1 session", f"{s['m']} sessions (aggregate)"], vals, color=["tab:orange", "tab:green"])
    a.annotate(f"{s['aggregate_over_single']:.2f}x (paired per round)", (1, vals[1]), ha="center", va="bottom")
    a.set_ylim(0, 1.15 * max(vals + [1.0]))
    a.set_ylabel("tokens/s")
    a.set_title("pipeline: concurrent sessions")

    a = ax[1][0]
    # a waterfall: every stage's parts start where the previous stage's ended, so the row ends add up
    # to the ring (median parts do not sum exactly to the median ring; the title gives the measured one)
    colors = {"transit": "tab:blue", "queue": "tab:orange", "compute": "tab:green", "send": "tab:red"}
    names = [f"stage {x['stage']}" for x in p["stages"]] + ["return + origin"]
    at = 0.0
    for x, name in zip(p["stages"], names):
        for part in ("transit", "queue", "compute", "send"):
            a.barh(name, x[part], left=at, color=colors[part])
            at += x[part]
    for part, val, color in (("return", p["return_ms"], "tab:purple"), ("origin", p["origin_ms"], "tab:gray")):
        a.barh(names[-1], max(0.0, val), left=at, color=color)
        at += max(0.0, val)
    labels = {"transit": "transit in", "queue": "queue", "compute": "compute", "send": "encode+send",
              "return": "token's return to the origin", "origin": "origin's own handling"}
    # lazy: matplotlib.patches costs 110 ms at start-up (python -X importtime, 2026-12-05)
    from matplotlib.patches import Patch

    a.legend(handles=[Patch(color={**colors, "return": "tab:purple", "origin": "tab:gray"}[k], label=v)
                      for k, v in labels.items()], fontsize=8, loc="upper right")
    a.invert_yaxis()
    a.set_xlabel("ms into a decode token's trip round the ring (medians)")
    a.set_title(f"where a decode token's time goes (ring {p['ring_ms']:.2f} ms; whole model "
                f"{w['decode_ms_per_token']:.2f} ms)")

    a = ax[1][1]
    bn = [x["boundary"] for x in p["boundaries"]]
    xs = range(len(bn))
    a.bar([x - 0.2 for x in xs], [x["median_ms"] for x in p["boundaries"]], 0.4, label="median")
    a.bar([x + 0.2 for x in xs], [x["p90_ms"] for x in p["boundaries"]], 0.4, label="p90")
    a.axhline(0.1, color="tab:red", linestyle="--", linewidth=1, label="0.1 ms (the C++ worker's first goal)")
    a.set_xticks(list(xs), bn)
    a.set_ylabel("ms per decode token")
    a.set_title(f"per-hop overhead per boundary (all: median {p['per_hop_ms']:.3f} ms)")
    a.legend(fontsize=8)

    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


__all__ = ["plot", "table"]
