"""Reading llama-batched-bench's rows (dgr.app.bench.batched_bench): the tool can exit 0 having lost some of its
output, so a run with rows missing is run again, and refused by name once the attempts are spent. A small
program that prints rows the way the tool does stands in for it (what is tested is the reading and the retry)."""

from __future__ import annotations

import logging
import sys

import pytest

from dgr.app.bench.batched_bench import ATTEMPTS, batched_bench_rows
from dgr.core.errors import DgrError

ROW = '{"pp": %d, "tg": 4, "pl": 1, "speed_pp": 100.0, "speed_tg": 50.0}'


def _program(tmp_path, body: str) -> list[str]:
    script = tmp_path / "bench.py"
    script.write_text("import pathlib, sys\nruns = pathlib.Path(sys.argv[1])\n"
                      "n = int(runs.read_text()) + 1 if runs.exists() else 1\nruns.write_text(str(n))\n" + body)
    return [sys.executable, str(script), str(tmp_path / "runs")]


def test_a_run_that_lost_rows_is_run_again(tmp_path, caplog):
    # the first run prints the first row only (what a CI run saw), the second both
    cmd = _program(tmp_path, f"print('{ROW % 8}')\nif n > 1:\n    print('{ROW % 16}')\nprint()\n")
    with caplog.at_level(logging.WARNING):
        rows = batched_bench_rows(cmd, 2)
    assert [r["pp"] for r in rows] == [8, 16]
    assert (tmp_path / "runs").read_text() == "2"
    assert "printed 1 of its 2 rows and exited 0 (run 1 of 3)" in caplog.text


def test_rows_still_missing_after_every_attempt_are_refused_by_name(tmp_path):
    cmd = _program(tmp_path, f"print('{ROW % 8}')\n")
    with pytest.raises(DgrError, match=rf"printed 1 of its 2 rows in each of {ATTEMPTS} runs \(exit 0\)"):
        batched_bench_rows(cmd, 2)
    assert (tmp_path / "runs").read_text() == str(ATTEMPTS)


def test_a_failing_run_is_refused_at_once_with_its_output(tmp_path):
    cmd = _program(tmp_path, "sys.stderr.write('error: failed to load model\\n')\nsys.exit(3)\n")
    with pytest.raises(DgrError, match="failed \\(exit 3\\): error: failed to load model"):
        batched_bench_rows(cmd, 1)
    assert (tmp_path / "runs").read_text() == "1"
