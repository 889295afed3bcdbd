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

REPO = Path(__file__).resolve().parents[1]
SERVER = REPO / "worker" / "server"
UNITS = sorted(SERVER.glob("*/*_test.cpp"))


def test_there_are_unit_tests_and_bazel_runs_each():
    assert UNITS, "no worker/server/<part>/*_test.cpp"
    build = (SERVER / "BUILD.bazel").read_text()
    for t in UNITS:
        rel = t.relative_to(SERVER).as_posix()
        assert re.search(rf'cc_test\(\s*name = "{t.stem}"', build), f"worker/server/BUILD.bazel has no cc_test {t.stem}"
        assert f'"{rel}"' in build, f"the cc_test {t.stem} does not compile {rel}"


@pytest.mark.parametrize("unit", UNITS, ids=[t.stem for t in UNITS])
def test_unit(unit: Path):
    exe = ensure_tool(f"dgr-unit-{unit.stem}")
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"{unit.relative_to(REPO)} failed:\n{run.stdout}{run.stderr}"
    assert "all checks passed" in run.stdout
