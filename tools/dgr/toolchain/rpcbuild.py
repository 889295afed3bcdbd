"""llama.cpp's own RPC backend, built from the pinned tree as upstream ships it (no dgr patch): `rpc-server` and
`llama-batched-bench`, what `dgr bench peers` runs beside a dgr route (docs/measurements.md, "Against llama.cpp's
RPC backend").

    ensure_rpc() -> {"ggml-rpc-server": <workspace>/build/rpc/bin/ggml-rpc-server, "llama-batched-bench": ...}

Built once with upstream's own CMake (GGML_RPC on, the CPU backend for the same x86-64-v3 baseline as dgr's
engine, ccache), then cached like the engine: a stamp records the inputs (pin, CMake arguments, compiler) and
nothing runs while they match and the programs are there.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from dgr.core.errors import EngineError
from dgr.core.locks import locked
from dgr.core.log import get_logger
from dgr.core.paths import workspace
from dgr.toolchain import upstream
from dgr.toolchain.enginebuild import check_tools, run_logged
from dgr.toolchain.pin import load_pin

log = get_logger(__name__)

TARGETS = ("ggml-rpc-server", "llama-batched-bench")
# ggml's own switches for the x86-64-v3 set (upstream's CMake has no per-target -march hook): AVX2, FMA, F16C,
# BMI2 and what they imply; the same instructions dgr's engine is compiled for (docs/numerics.md)
_CPU_FLAGS = ["-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
              "-DGGML_F16C=ON", "-DGGML_BMI2=ON"]


def cmake_args(src: Path, bdir: Path) -> list[str]:
    return ["-S", str(src), "-B", str(bdir), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_CCACHE=ON",
            "-DGGML_RPC=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_COMMON=ON",
            "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
            "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF", *_CPU_FLAGS]


def ensure_rpc(*, ws: Path | None = None, jobs: int | None = None, progress: bool = True) -> dict[str, Path]:
    """Build (or reuse) llama.cpp's rpc-server and llama-batched-bench from the pinned, verified, unpatched tree."""
    pin = load_pin()
    tools = check_tools()
    upstream.fetch(pin, ws)
    upstream.verify(pin, ws)
    src = upstream.layout(pin, ws).pristine
    bdir = (Path(ws) if ws is not None else workspace()) / "build" / "rpc"
    args = cmake_args(src, bdir)
    inputs = {"commit": pin.commit, "tree_hash": pin.tree_hash, "cmake_args": args, "compiler": tools["cxx_version"]}
    exes = {t: bdir / "bin" / t for t in TARGETS}
    stamp = bdir / "dgr-build.stamp.json"

    def fresh() -> bool:
        return stamp.is_file() and json.loads(stamp.read_text()).get("inputs") == inputs and \
            all(p.is_file() for p in exes.values())

    if fresh():
        return exes
    bdir.mkdir(parents=True, exist_ok=True)
    with locked(bdir.parent / f".{bdir.name}.lock"):
        if fresh():
            return exes
        logfile = bdir / "dgr-build.log"
        logfile.write_text("")
        t0 = time.monotonic()
        run_logged(["cmake", *args], logfile, "configure llama.cpp (RPC)", progress=False)
        env = {"CCACHE_BASEDIR": str(bdir.parents[1]), **os.environ}
        run_logged(["cmake", "--build", str(bdir), "-j", str(jobs or min(2, os.cpu_count() or 1)), "--target",
                    *TARGETS], logfile, "build llama.cpp (RPC)", progress=progress, env=env)
        missing = [str(p) for p in exes.values() if not p.is_file()]
        if missing:
            raise EngineError(f"the RPC build did not produce {', '.join(missing)} (see {logfile})")
        seconds = round(time.monotonic() - t0, 1)
        stamp.write_text(json.dumps({"inputs": inputs, "build_seconds": seconds}, indent=2) + "\n")
        log.info("llama.cpp's rpc-server and llama-batched-bench built in %ss: %s", seconds, bdir / "bin")
    return exes
