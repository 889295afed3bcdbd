"""`ensure_engine`: builds a CMake project over the patched upstream, then reuses it until an input
changes. Uses a stand-in engine project (a real CMake/Ninja build, seconds) over the tiny upstream;
the real engine is built by the engine tests through the same function.
"""

from __future__ import annotations

import ctypes
import shutil
import uuid

import pytest

from dgr.core.errors import EngineError
from dgr.toolchain import enginebuild, upstream

from support.upstream import format_patch, http_dir, tiny  # noqa: F401  (fixtures)

STANDIN_CMAKE = """cmake_minimum_required(VERSION 3.16)
project(standin CXX)
add_library(dgr_engine SHARED engine.cpp)
target_include_directories(dgr_engine PRIVATE ${DGR_LLAMA_SRC}/include)
set_target_properties(dgr_engine PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR})
"""
ENGINE_CPP = '#include "llama.h"\nextern "C" int dgr_value(void) { return TINY_LLAMA_VALUE * %d; }\n'


def _value(lib, tmp_path) -> int:
    # dlopen caches by name: load a uniquely named copy so a rebuilt library is really loaded.
    copy = tmp_path / f"lib-{uuid.uuid4().hex}.so"
    shutil.copy(lib, copy)
    return ctypes.CDLL(str(copy)).dgr_value()


@pytest.fixture
def standin(tiny, tmp_path):
    worker = tmp_path / "worker"
    worker.mkdir()
    (worker / "CMakeLists.txt").write_text(STANDIN_CMAKE)
    (worker / "engine.cpp").write_text(ENGINE_CPP % 1)
    format_patch(tiny["tree"], [("Hook", {"include/llama.h": "#pragma once\n#define TINY_LLAMA_VALUE 42\n"})],
                 tiny["repo"] / "patches" / "llama.cpp")
    upstream.pin_patches(upstream.load_pin(tiny["pin"]))
    return {**tiny, "worker": worker, "pin_obj": upstream.load_pin(tiny["pin"])}


@pytest.mark.skipif(not (shutil.which("cmake") and shutil.which("ninja")), reason="needs cmake and ninja")
def test_build_then_reuse_then_rebuild_on_change(standin, tmp_path):
    kw = dict(pin=standin["pin_obj"], ws=standin["ws"], worker_dir=standin["worker"])
    lib = enginebuild.ensure_engine("cpu", **kw)
    assert lib == standin["ws"] / "build" / "cpu" / "libdgr_engine.so"
    assert _value(lib, tmp_path) == 42  # built over the patched tree
    log = lib.parent / "dgr-build.log"
    log_mtime, lib_stat = log.stat().st_mtime_ns, lib.stat()

    # reuse: no CMake run and no new library (what a reuse does, not how long it takes)
    assert enginebuild.ensure_engine("cpu", **kw) == lib
    assert log.stat().st_mtime_ns == log_mtime  # CMake was not run at all
    assert (lib.stat().st_ino, lib.stat().st_mtime_ns) == (lib_stat.st_ino, lib_stat.st_mtime_ns)

    (standin["worker"] / "engine.cpp").write_text(ENGINE_CPP % 2)
    assert _value(enginebuild.ensure_engine("cpu", **kw), tmp_path) == 84
    assert "cmake --build" in log.read_text()

    # The reference build over the unpatched tree lives beside it and sees the pristine header.
    ref = enginebuild.ensure_engine("cpu", pristine=True, **kw)
    assert ref == standin["ws"] / "build" / "cpu-pristine" / "libdgr_engine.so"
    assert _value(ref, tmp_path) == 82


@pytest.mark.skipif(not (shutil.which("cmake") and shutil.which("ninja")), reason="needs cmake and ninja")
def test_removing_a_patch_rebuilds_what_it_touched(standin, tmp_path):
    # The header goes back to its pristine bytes (and the pristine file is older than the object):
    # the rebuild must still pick it up.
    kw = dict(ws=standin["ws"], worker_dir=standin["worker"])
    assert _value(enginebuild.ensure_engine("cpu", pin=standin["pin_obj"], **kw), tmp_path) == 42
    for p in (standin["repo"] / "patches" / "llama.cpp").glob("*.patch"):
        p.unlink()
    upstream.pin_patches(upstream.load_pin(standin["pin"]))
    assert _value(enginebuild.ensure_engine("cpu", pin=upstream.load_pin(standin["pin"]), **kw), tmp_path) == 41


@pytest.mark.skipif(not (shutil.which("cmake") and shutil.which("ninja")), reason="needs cmake and ninja")
def test_undoing_an_edit_in_the_patched_tree_rebuilds_the_pinned_engine(standin, tmp_path):
    # Patch development: an edit in the patched tree is built as it is; once undone, the next build must be the
    # pinned patches' again, not the edited library left behind under the old stamp.
    kw = dict(pin=standin["pin_obj"], ws=standin["ws"], worker_dir=standin["worker"])
    assert _value(enginebuild.ensure_engine("cpu", **kw), tmp_path) == 42
    header = upstream.ensure_patched(standin["pin_obj"], standin["ws"]) / "include" / "llama.h"
    pinned = header.read_bytes()
    header.write_text("#pragma once\n#define TINY_LLAMA_VALUE 43\n")
    assert _value(enginebuild.ensure_engine("cpu", **kw), tmp_path) == 43
    header.write_bytes(pinned)
    assert _value(enginebuild.ensure_engine("cpu", **kw), tmp_path) == 42


@pytest.mark.skipif(not (shutil.which("cmake") and shutil.which("ninja")), reason="needs cmake and ninja")
def test_a_library_in_the_wrong_place_is_reported(standin):
    (standin["worker"] / "CMakeLists.txt").write_text(STANDIN_CMAKE.replace(
        "LIBRARY_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}", "LIBRARY_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/lib"))
    with pytest.raises(EngineError, match=r"did not produce .*libdgr_engine.so; it was written to .*/lib/"):
        enginebuild.ensure_engine("cpu", pin=standin["pin_obj"], ws=standin["ws"], worker_dir=standin["worker"])


@pytest.mark.skipif(not (shutil.which("cmake") and shutil.which("ninja")), reason="needs cmake and ninja")
def test_a_compile_error_shows_the_log_tail(standin):
    (standin["worker"] / "engine.cpp").write_text("this is not C++\n")
    with pytest.raises(EngineError, match=r"build cpu failed(.|\n)*engine.cpp"):
        enginebuild.ensure_engine("cpu", pin=standin["pin_obj"], ws=standin["ws"], worker_dir=standin["worker"])


def test_missing_tools_say_what_to_install(standin, monkeypatch, tmp_path):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    with pytest.raises(EngineError, match=r"`cmake` is not on PATH.*apt-get install cmake ninja-build"):
        enginebuild.ensure_engine("cpu", pin=standin["pin_obj"], ws=standin["ws"], worker_dir=standin["worker"])


def test_unknown_lane_is_refused(standin):
    with pytest.raises(EngineError, match="unknown lane 'tpu'; lanes: cpu, cuda"):
        enginebuild.ensure_engine("tpu", pin=standin["pin_obj"], ws=standin["ws"], worker_dir=standin["worker"])


def test_ninja_status_lines_are_read_as_steps():
    assert enginebuild.ninja_step("[24/76] Building CXX object src/llama.cpp.o\n") == (24, 76)
    assert enginebuild.ninja_step("[1/1] Linking CXX shared library libdgr_engine.so") == (1, 1)
    for line in ("-- Configuring done", "[ 50%] Building (make style)", "[a/b] x", "[3] x", ""):
        assert enginebuild.ninja_step(line) is None


FAKE_NINJA = "import sys\nfor i in range(1, 4): print(f'[{i}/3] step {i}', flush=True)\nsys.exit(int(sys.argv[1]))\n"


@pytest.mark.parametrize("tty", [True, False])
def test_build_progress_is_a_bar_on_a_terminal_and_the_total_is_logged(tmp_path, monkeypatch, capsys, caplog, tty):
    import logging
    import sys

    script = tmp_path / "ninja.py"
    script.write_text(FAKE_NINJA)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
    log = tmp_path / "build.log"
    with caplog.at_level(logging.INFO, logger="dgr"):
        enginebuild.run_logged([sys.executable, str(script), "0"], log, "build cpu", progress=True)
    assert "[3/3] step 3" in log.read_text()  # the whole output is in the log
    assert "build cpu: 3/3 steps" in caplog.text  # the same final information either way
    err = capsys.readouterr().err
    assert ("build cpu" in err and "/3 [" in err) == tty  # a bar (tqdm's "n/3 [time]") only on a terminal
    with pytest.raises(EngineError, match=r"build cpu failed \(exit 1\)(.|\n)*\[3/3\] step 3"):
        enginebuild.run_logged([sys.executable, str(script), "1"], log, "build cpu", progress=False)
    assert "/3 [" not in capsys.readouterr().err  # progress=False: no bar, even on a terminal
