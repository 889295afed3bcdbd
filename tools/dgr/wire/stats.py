"""Where a generation's time went: tokens/s, and per-hop overhead (ring time outside compute)."""

from __future__ import annotations

import statistics

from dgr.wire.client import Generation


def _median(xs) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else 0.0


def decode_events(gen: Generation):
    """Decode tokens with a full ring measured (the first token answers the prefill)."""
    return [e for e in gen.events[1:] if e.ring_ns]


def hop_overhead_ms(gen: Generation, n_stages: int) -> float:
    """Median over decode tokens of (ring time - summed compute) / boundaries crossed, in ms.

    A decode token leaves the origin (stage 0), crosses n_stages - 1 seams and comes back to the origin:
    n_stages boundaries in the ring (1 for a one-stage route: the loop back to itself)."""
    return _median((e.ring_ns - e.compute_ns) / 1e6 / max(1, n_stages) for e in decode_events(gen))


def breakdown(gen: Generation) -> list[dict[str, float]]:
    """Per stage, median ms over decode tokens: transit into it, queue, compute, encode+send; the last
    row is the token's return to the origin."""
    evs = decode_events(gen)
    if not evs:
        return []
    rows = []
    for k in range(len(evs[0].timings)):
        rows.append({"stage": evs[0].timings[k][0],
                     **{name: _median(e.timings[k][j] / 1e6 for e in evs if len(e.timings) > k)
                        for j, name in enumerate(("transit", "queue", "compute", "send"), start=1)}})
    rows.append({"stage": -1, "transit": _median(e.return_ns / 1e6 for e in evs)})
    return rows


def summarize(gen: Generation, n_stages: int) -> str:
    evs = decode_events(gen)
    lines = [f"prompt {len(gen.prompt_ids)} tokens: prefill {gen.prefill_tokens_per_s:.1f} tok/s; "
             f"{len(gen.token_ids)} tokens: decode {gen.decode_tokens_per_s:.1f} tok/s; "
             f"ring {_median(e.ring_ns / 1e6 for e in evs):.2f} ms/token (compute "
             f"{_median(e.compute_ns / 1e6 for e in evs):.2f} ms); per-hop overhead "
             f"{hop_overhead_ms(gen, n_stages):.2f} ms over {n_stages} boundaries; epochs {gen.epochs}"]
    for row in breakdown(gen):
        if row["stage"] < 0:
            lines.append(f"  return to origin: transit {row['transit']:.2f} ms")
        else:
            lines.append(f"  stage {row['stage']}: transit in {row['transit']:.2f}, queue {row['queue']:.2f}, "
                         f"compute {row['compute']:.2f}, encode+send {row['send']:.2f} ms")
    return "\n".join(lines)
