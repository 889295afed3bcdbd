"""The speed gate's judgement: measured numbers and a contract's [speed] in, certificate rows out.

Pure (no engine, no clock): `dgr certify` measures (dgr.app.certify.runner.measure_speed) and hands the
numbers here; tests give it numbers of their own. Pipeline and whole model are measured side by side, round
after round, alternating which goes first, so each round's ratio (pipeline tok/s over whole-model tok/s) sees
the same load on both sides. A row is judged by the per-round ratios (`judge`):

- the figure is their median, with their interquartile range (the middle half of the rounds);
- passed when the whole range is at or above the threshold (its lower quartile is), failed when it is all
  below (its upper quartile is), and otherwise **inconclusive**: the rounds disagree about the threshold,
  which is what a busy machine does to a bundle whose ratio is near it (one run measured 0.993 < 1.0 on a
  loaded host and passed on a rerun). An inconclusive row is not a pass (dgr.app.certify.verdict).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from itertools import zip_longest

from dgr.app.certify.contract import Speed
from dgr.app.certify.verdict import INCONCLUSIVE
from dgr.core.certificate import Figure

PASS, FAIL, UNDECIDED = "pass", "fail", "inconclusive"


@dataclass(frozen=True)
class SpeedRuns:
    """What the speed gate measured on one host: tok/s of every timed round, one entry per round on each
    side (the untimed warm-up round is not in them). Round k (from 0) ran the pipeline first when k is even,
    the whole model first when it is odd."""

    prefill_tokens: int                     # the long prompt's length in tokens
    threads: int                            # compute threads per process
    pipeline_decode: tuple[float, ...]
    whole_decode: tuple[float, ...]
    pipeline_prefill: tuple[float, ...]
    whole_prefill: tuple[float, ...]


@dataclass(frozen=True)
class Judged:
    """One speed row's decision: the per-round ratios, their median and quartiles, and the verdict."""

    ratios: tuple[float, ...]
    median: float
    q1: float                               # lower quartile of the per-round ratios
    q3: float                               # upper quartile
    verdict: str                            # PASS, FAIL or UNDECIDED


def round_ratios(pipeline, whole) -> tuple[float, ...]:
    """pipeline[k] / whole[k] of every round; 0 for a round where either side measured nothing."""
    return tuple(p / w if p and w else 0.0 for p, w in zip_longest(pipeline, whole, fillvalue=0.0))


def quartiles(xs: tuple[float, ...]) -> tuple[float, float]:
    """Lower and upper quartile (linear interpolation between rounds, as numpy's default); one round: itself."""
    if len(xs) < 2:
        return (xs[0], xs[0]) if xs else (0.0, 0.0)
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q3


def judge(pipeline, whole, minimum: float) -> Judged:
    """The decision of one row: the per-round ratios against `minimum` (the module docstring). No rounds:
    a failure (ratio 0)."""
    rs = round_ratios(pipeline, whole)
    if not rs:
        return Judged((), 0.0, 0.0, 0.0, FAIL)
    q1, q3 = quartiles(rs)
    verdict = PASS if q1 >= minimum else FAIL if q3 < minimum else UNDECIDED
    return Judged(rs, statistics.median(rs), q1, q3, verdict)


def _median(xs) -> float:
    return statistics.median(xs) if xs else 0.0


def _figure(check: str, j: Judged, minimum: float, pipeline, whole, how: str) -> Figure:
    spread = (f"per-round ratios over {len(j.ratios)} round(s), pipeline and whole model side by side, alternating "
              f"which goes first: median {j.median:.3f}, interquartile {j.q1:.3f}-{j.q3:.3f}, min "
              f"{min(j.ratios, default=0.0):.3f}, max {max(j.ratios, default=0.0):.3f}; median tok/s: pipeline "
              f"{_median(pipeline):.1f}, whole model {_median(whole):.1f} ({how})")
    if j.verdict == UNDECIDED:
        spread = (f"{INCONCLUSIVE}: the interquartile range of the per-round ratios covers the threshold "
                  f"{minimum}, so this row is not a pass (rerun on a quieter machine); " + spread)
    return Figure(check=check, figure=f"{j.median:.3f} (IQR {j.q1:.3f}-{j.q3:.3f})", threshold=f">= {minimum}",
                  passed=j.verdict == PASS, detail=spread)


def speed_figures(m: SpeedRuns, s: Speed) -> list[Figure]:
    """The decode and prefill rows: each judged against its threshold in `s` (>= it)."""
    how = f"{m.threads} thread(s) per process"
    return [
        _figure("speed: decode ratio", judge(m.pipeline_decode, m.whole_decode, s.decode_ratio_min),
                s.decode_ratio_min, m.pipeline_decode, m.whole_decode, f"{s.decode_tokens} tokens, {how}"),
        _figure(f"speed: prefill ratio ({m.prefill_tokens} tokens)",
                judge(m.pipeline_prefill, m.whole_prefill, s.prefill_ratio_min), s.prefill_ratio_min,
                m.pipeline_prefill, m.whole_prefill, how),
    ]
