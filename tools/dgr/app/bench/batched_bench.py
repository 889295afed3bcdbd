"""Running llama.cpp's own `llama-batched-bench` (the stock side of `dgr bench kernels` and of `dgr bench peers`)
and reading its JSON lines.

The tool prints its rows, and its log, through llama.cpp's asynchronous logger (common/log.cpp), and some of
it can be lost. Twice on this project's machines a run exited 0 with rows missing and nothing on stderr: once
with no row at all, once (a CI run, 2026-12-06) with the first of two rows only. A run whose rows are not all
there is run again, up to ATTEMPTS times, then refused with what came back.
"""

from __future__ import annotations

import json
import subprocess

from dgr.core.errors import DgrError
from dgr.core.log import get_logger

log = get_logger(__name__)

ATTEMPTS = 3


def batched_bench_rows(cmd: list[str], expected: int, *, timeout: float = 3600) -> list[dict]:
    """`cmd` (a llama-batched-bench command line with `--output-format jsonl`) run until it prints `expected`
    rows; its rows in the order printed."""
    rows: list[dict] = []
    out = None
    for attempt in range(1, ATTEMPTS + 1):
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise DgrError(f"llama-batched-bench failed (exit {out.returncode}): {(out.stderr or out.stdout)[-2000:]}")
        rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        if len(rows) == expected:
            return rows
        log.warning("llama-batched-bench printed %d of its %d rows and exited 0 (run %d of %d): running it again",
                    len(rows), expected, attempt, ATTEMPTS)
    raise DgrError(f"llama-batched-bench printed {len(rows)} of its {expected} rows in each of {ATTEMPTS} runs "
                   f"(exit 0): {out.stdout[-1000:]}{out.stderr[-1000:]}")


__all__ = ["ATTEMPTS", "batched_bench_rows"]
