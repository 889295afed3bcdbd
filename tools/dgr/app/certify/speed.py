"""The speed gate's judgement: measured numbers and a contract's [speed] in, certificate rows out.

Pure (no engine, no clock): `dgr certify` measures (dgr.app.certify.runner.measure_speed) and hands the
numbers here; tests give it numbers of their own. Each ratio is of each side's fastest timed run
(timeit's rule: the run least disturbed by other work on a shared host); the medians go into the detail.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from dgr.app.certify.contract import Speed
from dgr.core.certificate import Figure


@dataclass(frozen=True)
class SpeedRuns:
    """What the speed gate measured on one host: tok/s of every timed run, pipeline and whole model
    alternating (the untimed warm-up round is not in them)."""

    prefill_tokens: int                     # the long prompt's length in tokens
    threads: int                            # compute threads per process
    pipeline_decode: tuple[float, ...]
    whole_decode: tuple[float, ...]
    pipeline_prefill: tuple[float, ...]
    whole_prefill: tuple[float, ...]


def _median(xs) -> float:
    return statistics.median(xs) if xs else 0.0


def best_ratio(pipeline, whole) -> float:
    """The pipeline's fastest run over the whole model's fastest run; 0 when the whole model has none."""
    w = max(whole, default=0.0)
    return max(pipeline, default=0.0) / w if w else 0.0


def speed_figures(m: SpeedRuns, s: Speed) -> list[Figure]:
    """The decode and prefill rows: each ratio against its threshold in `s` (passes when >= it)."""
    pd, wd, pp, wp = m.pipeline_decode, m.whole_decode, m.pipeline_prefill, m.whole_prefill
    rd, rp = best_ratio(pd, wd), best_ratio(pp, wp)
    how = f"best of {s.repeats}, {m.threads} thread(s) per process"
    return [
        Figure(check="speed: decode ratio", figure=round(rd, 3), threshold=f">= {s.decode_ratio_min}",
               passed=rd >= s.decode_ratio_min,
               detail=f"pipeline {max(pd, default=0.0):.1f} tok/s, whole model {max(wd, default=0.0):.1f} tok/s "
                      f"({s.decode_tokens} tokens, {how}; medians {_median(pd):.1f} and {_median(wd):.1f})"),
        Figure(check=f"speed: prefill ratio ({m.prefill_tokens} tokens)", figure=round(rp, 3),
               threshold=f">= {s.prefill_ratio_min}", passed=rp >= s.prefill_ratio_min,
               detail=f"pipeline {max(pp, default=0.0):.1f} tok/s, whole model {max(wp, default=0.0):.1f} tok/s "
                      f"({how}; medians {_median(pp):.1f} and {_median(wp):.1f})"),
    ]
