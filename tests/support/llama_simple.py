"""llama.cpp's own `llama-simple` for tests that check llama.cpp itself accepts a file: $DGR_LLAMA_BIN's,
or built on demand from the engine's CMake build (worker/CMakeLists.txt, target llama-simple over the
same pinned, patched llama library; seconds once the engine is built, then cached by Ninja)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

BIN_ENV = "DGR_LLAMA_BIN"   # a folder with a llama-simple of the pinned llama.cpp (e.g. upstream's own)
TARGET = "llama-simple"


def llama_simple() -> Path:
    """The path of a runnable llama-simple; builds it when $DGR_LLAMA_BIN is unset. Never skips: a
    missing toolchain or a failed build fails the test that asked."""
    env = os.environ.get(BIN_ENV)
    if env:
        exe = Path(env) / TARGET
        if not exe.is_file():
            raise FileNotFoundError(f"${BIN_ENV}={env} has no {TARGET}; unset it to build one")
        return exe
    from dgr.core.locks import locked
    from dgr.toolchain.enginebuild import ensure_engine

    bdir = ensure_engine("cpu").parent  # the configured CMake tree (built and cached like the engine)
    # the same lock as the engine build of this folder: one Ninja at a time in it
    with locked(bdir.parent / f".{bdir.name}.lock"):
        out = subprocess.run(["cmake", "--build", str(bdir), "-j", str(min(2, os.cpu_count() or 1)),
                              "--target", TARGET], capture_output=True, text=True,
                             env={"CCACHE_BASEDIR": str(bdir.parents[1]), **os.environ})
    if out.returncode != 0:
        raise RuntimeError(f"building {TARGET} in {bdir} failed (exit {out.returncode}):\n"
                           f"{(out.stdout + out.stderr)[-3000:]}")
    exe = bdir / "bin" / TARGET
    if not exe.is_file():
        raise RuntimeError(f"the build did not produce {exe} (worker/CMakeLists.txt sets its output folder)")
    return exe
