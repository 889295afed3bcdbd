"""A generation's record (its tokens, the faults it recovered from) and where its time went: tokens/s,
per-hop overhead (ring time outside compute). The route client (dgr.runtime.wire.client) fills the records."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import numpy as np


@dataclass
class TokenEvent:
    token_id: int
    text: str
    position: int
    epoch: int
    ring_ns: int
    compute_ns: int                      # summed over the stages this token passed through
    logits: np.ndarray | None = None     # LOGITS_LAST: the row the token was sampled from
    # per stage: (stage, transit in, queue, compute, encode+send) in ns
    timings: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    return_ns: int = 0                   # transit of the token from the last stage to the origin
    # speculation: a draft accepted in a ring that a later token closes (no timings of its own); on the
    # token that closes a ring, the drafts that ring verified and how many of them it accepted
    speculated: bool = False
    drafted: int = 0
    accepted: int = 0
    # generate(logprobs=True / top_logprobs=n): the model's log-probability of this token, and the n most
    # likely tokens at its position as (token id, logprob), most likely first
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    at: float = 0.0                      # the client's time.perf_counter() when the token arrived


@dataclass
class Failure:
    """One failed attempt: which hop (stage index, "stage I (HOST:PORT)"), the error code and why."""

    stage: int | None
    address: str                         # the replica that failed ("" when no stage is known)
    hop: str
    code: str
    why: str
    at: float                            # time.monotonic() when the client saw it
    tokens: int                          # tokens generated before it


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logits: dict[int, np.ndarray] = field(default_factory=dict)   # position -> row
    events: list[TokenEvent] = field(default_factory=list)
    epochs: int = 0
    chunk_tokens: int = 0                # prefill tokens per step, the same at every stage
    cached_tokens: int = 0               # prompt positions every hop restored from its prefix cache (not prefilled)
    failures: list[Failure] = field(default_factory=list)         # recovered from (or the last: gave up)
    routes: list[str] = field(default_factory=list)               # the route of every epoch, in order
    numerics: list[str] = field(default_factory=list)             # each stage's numerics (the last epoch's route)
    exact: bool = True                   # every epoch's stages computed alike (False only with mixed numerics allowed)
    t_start: float = 0.0
    t_first: float = 0.0
    t_last: float = 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        dt = self.t_first - self.t_start
        return len(self.prompt_ids) / dt if dt > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        dt = self.t_last - self.t_first
        return (len(self.token_ids) - 1) / dt if dt > 0 and len(self.token_ids) > 1 else 0.0


def concurrent_decode_tokens_per_s(gens) -> float:
    """Aggregate decode rate of sessions that ran at once, as llama-batched-bench's S_TG measures its parallel
    sequences: the tokens that arrived while every session was decoding (after the last one's first token, up to
    the first one's last token) over that window; 0.0 when there was no such time. Prefill is left out, and so is
    a tail where some sessions had finished."""
    gens = [g for g in gens if g.events]
    if not gens:
        return 0.0
    t0, t1 = max(g.t_first for g in gens), min(g.t_last for g in gens)
    n = sum(1 for g in gens for e in g.events if t0 < e.at <= t1)
    return n / (t1 - t0) if t1 > t0 else 0.0


def _median(xs) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else 0.0


def rings(gen: Generation) -> int:
    """Trips round the ring that returned tokens (a speculative ring returns its accepted drafts too)."""
    return sum(1 for e in gen.events if not e.speculated)


def tokens_per_ring(gen: Generation) -> float:
    """Decode tokens per decode ring (the prefill's ring, which returns the first token, left out):
    1.0 without speculation, up to k+1 with k drafts all accepted every time."""
    n = rings(gen) - 1
    return (len(gen.events) - 1) / n if n > 0 else 0.0


def draft_stats(gen: Generation) -> tuple[int, int]:
    """(drafts sent, drafts accepted) over the generation."""
    return sum(e.drafted for e in gen.events), sum(e.accepted for e in gen.events)


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
    drafted, accepted = draft_stats(gen)
    if drafted:
        lines.append(f"speculation: {tokens_per_ring(gen):.2f} tokens per ring; {accepted} of {drafted} drafts "
                     f"accepted ({100 * accepted / drafted:.0f}%)")
    if gen.failures:
        lines.append(f"recovered from {len(gen.failures)} failed attempt(s) over {len(gen.routes)} route(s): "
                     + "; ".join(f"{f.hop or 'route'} {f.code} after {f.tokens} tokens" for f in gen.failures))
    for row in breakdown(gen):
        if row["stage"] < 0:
            lines.append(f"  return to origin: transit {row['transit']:.2f} ms")
        else:
            lines.append(f"  stage {row['stage']}: transit in {row['transit']:.2f}, queue {row['queue']:.2f}, "
                         f"compute {row['compute']:.2f}, encode+send {row['send']:.2f} ms")
    return "\n".join(lines)
