"""Where a generation's time went: tokens/s, and per-hop overhead (ring time outside compute)."""

from __future__ import annotations

import statistics

from dgr.wire.client import Generation


def hop_overhead_ms(gen: Generation, n_stages: int) -> float:
    """Median over decode tokens of (ring time - summed compute) / boundaries crossed, in ms.

    A decode token leaves the origin (stage 0), crosses n_stages - 1 seams and comes back to the origin:
    n_stages boundaries in the ring (1 for a one-stage route: the loop back to itself)."""
    per = [(e.ring_ns - e.compute_ns) / 1e6 / max(1, n_stages) for e in gen.events[1:] if e.ring_ns]
    return statistics.median(per) if per else 0.0


def summarize(gen: Generation, n_stages: int) -> str:
    ring = [e.ring_ns / 1e6 for e in gen.events[1:] if e.ring_ns]
    comp = [e.compute_ns / 1e6 for e in gen.events[1:] if e.ring_ns]
    return (f"prompt {len(gen.prompt_ids)} tokens: prefill {gen.prefill_tokens_per_s:.1f} tok/s; "
            f"{len(gen.token_ids)} tokens: decode {gen.decode_tokens_per_s:.1f} tok/s; "
            f"ring {statistics.median(ring) if ring else 0:.2f} ms/token (compute "
            f"{statistics.median(comp) if comp else 0:.2f} ms); per-hop overhead "
            f"{hop_overhead_ms(gen, n_stages):.2f} ms over {n_stages} boundaries; epochs {gen.epochs}")
