"""A certification's verdict from its rows, and the exit code `dgr certify` and `dgr gate` return for it.

A row passes or not (`Figure.passed`). A speed row that could not decide, because the spread of its per-round
ratios covers its threshold (dgr.app.certify.speed.judge), is not a pass either: `passed` is false and its
detail begins with INCONCLUSIVE. The certificate format stays dgr.certificate/v1 (dgr-worker reads it too,
worker/server/certification.cpp, and refuses fields it does not know), so the detail is where that is said.

- passed: every row passed (exit 0);
- failed: a row failed outright (exit 1), whatever else was inconclusive;
- inconclusive: no row failed, but a speed row could not decide (exit 3): rerun on a quieter machine.

Exit 2 stays a refusal or an error (dgr.core.errors.DgrError).
"""

from __future__ import annotations

from collections.abc import Iterable

from dgr.core.certificate import Figure

PASSED, FAILED, INCONCLUSIVE_RUN = "passed", "failed", "inconclusive"
EXIT_CODES = {PASSED: 0, FAILED: 1, INCONCLUSIVE_RUN: 3}

# how the detail of an undecided row begins (and what the tables and the CLI say)
INCONCLUSIVE = "inconclusive: the machine was busy"


def is_inconclusive(f: Figure) -> bool:
    """A row that did not pass because its measurements could not decide (not a pass, not a failure)."""
    return not f.passed and f.detail.startswith(INCONCLUSIVE)


def overall(figures: Iterable[Figure]) -> str:
    """PASSED, FAILED or INCONCLUSIVE_RUN for these rows (no rows: FAILED, a run that checked nothing)."""
    figs = list(figures)
    if not figs or any(not f.passed and not is_inconclusive(f) for f in figs):
        return FAILED
    return INCONCLUSIVE_RUN if any(is_inconclusive(f) for f in figs) else PASSED


def exit_code(figures: Iterable[Figure]) -> int:
    return EXIT_CODES[overall(figures)]


def mark(f: Figure) -> str:
    """The pass column of a table: yes, NO, or inconclusive."""
    return "yes" if f.passed else "inconclusive" if is_inconclusive(f) else "NO"
