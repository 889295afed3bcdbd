"""Under CI a skip fails the test unless its file is in tests/conftest.py's CI_MAY_SKIP: run a small test
file that skips, under pytest, with CI=true and without."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from support.paths import REPO

SKIPPING = '''
import pytest

def test_needs_a_tool_this_machine_lacks():
    pytest.skip("no frobnicator on PATH")

@pytest.mark.skipif(True, reason="never here")
def test_marked():
    pass
'''


def _run(tmp_path: Path, name: str, ci: str | None) -> subprocess.CompletedProcess:
    shutil.copy(REPO / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / name).write_text(SKIPPING)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / name)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)


def test_a_skip_fails_under_ci_and_says_what_to_do(tmp_path):
    r = _run(tmp_path, "test_skipper.py", "true")
    assert r.returncode == 1, r.stdout
    assert "2 failed" in r.stdout or "2 errors" in r.stdout or "1 failed, 1 error" in r.stdout, r.stdout
    assert "skipped under CI" in r.stdout and "no frobnicator on PATH" in r.stdout and "CI_MAY_SKIP" in r.stdout


def test_a_skip_is_a_skip_outside_ci(tmp_path):
    r = _run(tmp_path, "test_skipper.py", None)
    assert r.returncode == 0 and "2 skipped" in r.stdout, r.stdout


def test_a_listed_file_may_skip_under_ci(tmp_path):
    r = _run(tmp_path, "test_lane_vulkan.py", "true")
    assert r.returncode == 0 and "2 skipped" in r.stdout, r.stdout
