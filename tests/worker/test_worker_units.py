"""The C++ worker's parts on their own (docs/worker.md "Parts and their owners"): every
worker/server/<part>/*_test.cpp is a plain C++ program over its part's header, with nothing of gRPC or the
engine. Here each is built in the CPU lane's CMake tree (`dgr-unit-<name>`, cached by Ninja) and run; Bazel
runs the same files as cc_tests (worker/server/BUILD.bazel), and a test below keeps the two lists equal."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from dgr.toolchain.enginebuild import ensure_tool

from support.paths import REPO

SERVER = REPO / "worker" / "server"
UNITS = sorted(SERVER.glob("*/*_test.cpp"))


def test_there_are_unit_tests_and_both_builds_take_every_one():
    """Bazel makes a cc_test of every <part>/*_test.cpp, CMake a dgr-unit-<name>: both by glob, so a new test
    needs no line in either; the worker itself is built without them."""
    assert UNITS, "no worker/server/<part>/*_test.cpp"
    build = (SERVER / "BUILD.bazel").read_text()
    assert re.search(r'\[cc_test\((.|\n)*\) for t in glob\(\["\*/\*_test\.cpp"\]\)\]', build), \
        "worker/server/BUILD.bazel: no cc_test per */*_test.cpp"
    worker = build.split('name = "dgr-worker"')[1].split("cc_test")[0]
    assert 'glob(["*.cpp", "*.h", "*/*.cpp", "*/*.h"], exclude = ["*/*_test.cpp"])' in worker, \
        "dgr-worker must take every part's sources and leave the tests out"
    cmake = (REPO / "worker" / "CMakeLists.txt").read_text()
    assert "server/*/*_test.cpp" in cmake and 'EXCLUDE REGEX "_test\\\\.cpp$"' in cmake
    assert len({t.stem for t in UNITS}) == len(UNITS), "two parts' tests share a name (the cc_test names clash)"


@pytest.mark.parametrize("unit", UNITS, ids=[t.stem for t in UNITS])
def test_unit(unit: Path):
    exe = ensure_tool(f"dgr-unit-{unit.stem}")
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"{unit.relative_to(REPO)} failed:\n{run.stdout}{run.stderr}"
    assert "all checks passed" in run.stdout
