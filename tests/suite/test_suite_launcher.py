"""The suite cannot pass by accident: a test module that collects nothing fails (through the Bazel
launcher, toolchains/bazel/dgr_launcher.py, run here without Bazel over a runfiles folder made in tmp),
every tests/<area>/test_*.py holds tests (and sits in one folder below tests/, its name unique), and the
`slow` marker selects real tests (CI runs `-m slow` and `-m "not slow"`, together the whole suite)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from support.paths import REPO

LAUNCHER = REPO / "toolchains/bazel/dgr_launcher.py"


def _launch(tmp_path: Path, body: str, *opts: str) -> subprocess.CompletedProcess:
    """dgr_launcher.py --pytest tests/suite/test_x.py, the test file found through a runfiles folder (the
    bzlmod layout, `_main/...`) as Bazel would lay it out."""
    rf = tmp_path / "runfiles"
    test = rf / "_main/tests/suite/test_x.py"
    test.parent.mkdir(parents=True)
    test.write_text(body)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNFILES_")}  # not an outer Bazel's
    env["RUNFILES_DIR"] = str(rf)
    return subprocess.run([sys.executable, str(LAUNCHER), "--pytest", "tests/suite/test_x.py", *opts],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_module_without_tests_fails(tmp_path):
    r = _launch(tmp_path, '"""helpers only"""\n\ndef helper():\n    return 1\n')
    assert r.returncode != 0, r.stdout + r.stderr
    assert "collected no tests" in r.stderr and "tests/support/" in r.stderr


def test_a_module_with_one_passing_test_passes(tmp_path):
    r = _launch(tmp_path, "def test_ok():\n    assert True\n")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 passed" in r.stdout


def test_a_failing_test_fails(tmp_path):
    r = _launch(tmp_path, "def test_bad():\n    assert False\n")
    assert r.returncode == 1, r.stdout + r.stderr


def test_tests_deselected_by_the_callers_options_are_not_an_empty_module(tmp_path):
    r = _launch(tmp_path, "import pytest\n\n@pytest.mark.slow\ndef test_long():\n    pass\n", "-mnot slow")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "deselected" in r.stderr


def test_a_file_missing_from_runfiles_is_an_error(tmp_path):
    rf = tmp_path / "runfiles"
    rf.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNFILES_")}
    env["RUNFILES_DIR"] = str(rf)
    r = subprocess.run([sys.executable, str(LAUNCHER), "--pytest", "tests/suite/test_gone.py"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "not in this target's runfiles" in r.stderr


def _collect(*opts: str) -> tuple[list[str], str]:
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *opts,
                        "tests"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [line for line in r.stdout.splitlines() if "::" in line], r.stdout


def test_every_test_module_holds_tests():
    ids, _ = _collect()
    with_tests = {i.split("::", 1)[0] for i in ids}
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "tests").rglob("test_*.py")}
    assert modules - with_tests == set(), "test modules that collect no tests (helpers go in tests/support/)"


def test_the_slow_marker_selects_real_tests():
    # not slow itself: under `-m slow` it would then select at least itself, and prove nothing
    ids, out = _collect("-m", "slow")
    assert len(ids) >= 1, out[-2000:]
    assert re.search(r"\d+/\d+ tests? collected \(\d+ deselected\)", out), out[-500:]


def test_every_test_file_sits_in_one_area_folder_under_a_name_of_its_own():
    # pytest imports each test module by its file name (rootdir-less "prepend" mode) and the Bazel target is
    # //tests:<file name> (toolchains/python.bzl): two files of one name would collide in both. Helpers go in
    # tests/support/, fixtures in tests/conftest.py; a test file directly in tests/ or two folders deep has no area.
    files = sorted((REPO / "tests").rglob("test_*.py"))
    misplaced = [p.relative_to(REPO).as_posix() for p in files if len(p.relative_to(REPO / "tests").parts) != 2
                 or p.parent.name == "support"]
    assert misplaced == [], "test files outside tests/<area>/ (docs/TEAM.md, \"Tests\")"
    names = [p.name for p in files]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})
