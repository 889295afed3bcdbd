"""llama.cpp's own `llama-simple` for tests that check llama.cpp itself accepts a file: $DGR_LLAMA_BIN's,
or built on demand from the engine's CMake build (worker/CMakeLists.txt, target llama-simple over the
same pinned, patched llama library; seconds once the engine is built, then cached by Ninja)."""

from __future__ import annotations

import os
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
    from dgr.toolchain.enginebuild import ensure_tool

    return ensure_tool(TARGET)
