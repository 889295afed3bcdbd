"""Build the ShardEngine library (worker/ over the patched llama.cpp) for one backend lane, cached.

    ensure_engine("cpu") -> <workspace>/build/cpu/libdgr_engine.so

The first build takes minutes (llama.cpp itself); later calls return in milliseconds: a stamp
records the build's inputs (pin commit and tree hash, the applied patches' blake3, a hash of every
file under worker/, the lane, the CMake arguments and the compiler) and CMake is not run at all when
it matches and the library is still the one built. When the inputs change, CMake and Ninja rebuild
only what changed, and ccache serves objects compiled before (GGML_CCACHE). The engine's own
worker/CMakeLists.txt (engine area) defines the shared library target `dgr_engine` and writes it
into the build folder's top level; it finds llama.cpp through -DDGR_LLAMA_SRC, and the pinned BLAKE3 C
sources dgr-worker compiles in (worker/third_party/blake3.json, dgr.toolchain.upstream.vendored) through
-DDGR_BLAKE3_SRC.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from dgr.core.constants import CPU_VARIANTS, LANES
from dgr.core.errors import EngineError
from dgr.core.hashing import file_blake3, series_hash
from dgr.core.locks import locked
from dgr.core.log import get_logger
from dgr.core.paths import ENGINE_LIBRARY, REPO_ROOT, engine_build_dir
from dgr.toolchain import treehash, upstream
from dgr.toolchain.pin import Pin, load_pin

log = get_logger(__name__)

TARGET = "dgr_engine"
LIBRARY = ENGINE_LIBRARY
# The stage worker as one C++ program (worker/server, docs/worker.md), built beside the library when the
# configure step found gRPC C++ (worker/CMakeLists.txt records that as DGR_WORKER_ENABLED).
WORKER_TARGET = WORKER_BINARY = "dgr-worker"
# The fake engine (worker/fake: a toy model behind the same C ABI, for tests; dgr.testing.fake_engine and
# `dgr-worker --fake-engine` load it), built beside the library: it compiles in a second, nothing of llama.cpp.
FAKE_TARGET = "dgr_fake_engine"
FAKE_LIBRARY = "libdgr_fake_engine.so"
WORKER_DIR = REPO_ROOT / "worker"

# CMake switches per lane (llama.cpp's GGML_* options). Only `cpu` is built and tested by this
# command here; the others are llama.cpp's documented switches, built by CI on their hardware.
LANE_FLAGS: dict[str, list[str]] = {
    "cpu": [],
    "cuda": ["-DGGML_CUDA=ON"],
    "rocm": ["-DGGML_HIP=ON"],
    "vulkan": ["-DGGML_VULKAN=ON"],
    "metal": ["-DGGML_METAL=ON"],
}
assert set(LANE_FLAGS) == set(LANES)

_INSTALL_HINT = "install it (Debian: apt-get install cmake ninja-build g++ ccache)"


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cxx or not shutil.which(cxx):
        raise EngineError(f"no C++ compiler found (CXX, c++, g++ or clang++); {_INSTALL_HINT}")
    return cxx


def check_tools() -> dict[str, str]:
    """The build tools, or an error naming what is missing and how to install it."""
    tools = {}
    for name in ("cmake", "ninja"):
        path = shutil.which(name)
        if not path:
            raise EngineError(f"`{name}` is not on PATH, and the engine build needs it; {_INSTALL_HINT}")
        tools[name] = path
    tools["cxx"] = _compiler()
    version = subprocess.run([tools["cxx"], "--version"], capture_output=True, text=True).stdout
    tools["cxx_version"] = version.splitlines()[0] if version else "unknown"
    return tools


# The CPU backend's instruction set (worker/CMakeLists.txt DGR_CPU_VARIANT, docs/numerics.md): the lane's declared
# baseline, as Bazel, Nix and the release build it, so every build's workers share a route; or "native", this
# machine's own CPU, into build/<lane>-native, with numerics of its own.
DEFAULT_CPU_VARIANT = CPU_VARIANTS[0]


def build_dir(lane: str = "cpu", ws: Path | None = None, *, pristine: bool = False,
              cpu_variant: str = DEFAULT_CPU_VARIANT) -> Path:
    """<workspace>/build/<lane> (`dgr.core.paths.engine_build_dir`, where the runtime looks for the library),
    build/<lane>-pristine for the engine over unpatched llama.cpp, build/<lane>-native for a build for this
    machine's own CPU; `ws` is another workspace (tests)."""
    name = lane + ("-pristine" if pristine else "") + ("-native" if cpu_variant == "native" else "")
    return engine_build_dir(name) if ws is None else Path(ws) / "build" / name


def upstream_defines(pin: Pin, *, pristine: bool = False) -> list[str]:
    """The pin as the engine's numerics name it (worker/engine/dgr_engine_numerics.cpp); Bazel's repository rule
    (toolchains/llama_cpp.bzl) defines the same three."""
    patches = [] if pristine else [(p.file, p.blake3) for p in pin.patches]
    return [f"-DDGR_UPSTREAM_COMMIT={pin.commit[:12]}", f"-DDGR_UPSTREAM_PATCHES={len(patches)}",
            f"-DDGR_UPSTREAM_SERIES={series_hash(patches)[:12]}"]


def cmake_args(lane: str, worker_dir: Path, bdir: Path, llama_src: Path, blake3_src: Path | None = None,
               cpu_variant: str = DEFAULT_CPU_VARIANT) -> list[str]:
    return [
        f"-DDGR_CPU_VARIANT={cpu_variant}",
        "-S", str(worker_dir), "-B", str(bdir), "-G", "Ninja",
        "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_CCACHE=ON",
        f"-DDGR_LLAMA_SRC={llama_src}",
        # dgr-worker's BLAKE3: the official C implementation, pinned and verified (worker/third_party/blake3.json)
        *([f"-DDGR_BLAKE3_SRC={blake3_src}"] if blake3_src else []),
        # The verified tree holds only what the tree hash covers (no tests/ or examples/).
        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
        f"-DDGR_LANE={lane}",
        *LANE_FLAGS[lane],
    ]


def _inputs(lane: str, pin: Pin, worker_dir: Path, args: list[str], tools: dict[str, str]) -> dict[str, Any]:
    return {
        "lane": lane,
        "commit": pin.commit,
        "tree_hash": pin.tree_hash,
        "patches": [[p.file, p.blake3] for p in pin.patches],
        "worker": treehash.tree_hash(worker_dir, treehash.any_file),
        # dgr-worker's C++ stubs are generated from the wire contract
        "proto": file_blake3(REPO_ROOT / "proto" / "dgr" / "v1" / "stage.proto"),
        "cmake_args": args,
        "compiler": tools["cxx_version"],
    }


def ninja_step(line: str) -> tuple[int, int] | None:
    """(done, total) from a Ninja status line `[24/76] Building CXX object ...`, else None."""
    if not line.startswith("["):
        return None
    head = line[1:].split("]", 1)[0]
    done, sep, total = head.partition("/")
    if not (sep and done.isdigit() and total.isdigit()):
        return None
    return int(done), int(total)


def run_logged(cmd: list[str], logfile: Path, what: str, progress: bool, env: dict[str, str] | None = None) -> None:
    """Run a build step, teeing its output to `logfile`; Ninja's steps drive a progress bar on a terminal."""
    log.info("%s: %s ... (log: %s)", what, " ".join(cmd[:4]), logfile)
    step: tuple[int, int] | None = None
    bar = tqdm(desc=what, unit="step", disable=not (progress and sys.stderr.isatty()), leave=False)
    with open(logfile, "a") as logf, bar:
        logf.write(f"$ {' '.join(cmd)}\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        assert proc.stdout
        for line in proc.stdout:
            logf.write(line)
            step = ninja_step(line) or step
            if step and not bar.disable:
                if bar.total != step[1]:  # known from the first step; grows when CMake re-runs mid-build
                    bar.total = step[1]
                    bar.refresh()
                bar.update(step[0] - bar.n)
        rc = proc.wait()
    if rc != 0:
        tail = "".join(logfile.read_text().splitlines(keepends=True)[-25:])
        raise EngineError(f"{what} failed (exit {rc}); the full log is {logfile}. Last lines:\n{tail}")
    if step:
        log.info("%s: %d/%d steps", what, *step)


def ensure_engine(
    lane: str = "cpu",
    *,
    pin: Pin | None = None,
    ws: Path | None = None,
    worker_dir: Path | None = None,
    jobs: int | None = None,
    force: bool = False,
    pristine: bool = False,
    defines: dict[str, str] | None = None,
    progress: bool = True,
    cpu_variant: str = DEFAULT_CPU_VARIANT,
) -> Path:
    """Build (or reuse) the engine library for `lane`; returns the library's path.

    `pristine=True` builds over the verified but unpatched tree (a reference build; pass the
    engine's own switch for that in `defines`, e.g. {"DGR_WITH_HOOKS": "OFF"}) into
    build/<lane>-pristine. `defines` are extra -D cache entries, part of the cached inputs.
    `progress` shows a bar of Ninja's steps on a terminal. `cpu_variant`: CPU_VARIANTS.
    """
    if lane not in LANE_FLAGS:
        raise EngineError(f"unknown lane {lane!r}; lanes: {', '.join(LANE_FLAGS)}")
    if cpu_variant not in CPU_VARIANTS:
        raise EngineError(f"unknown CPU variant {cpu_variant!r}; variants: {', '.join(CPU_VARIANTS)}")
    pin = pin or load_pin()
    worker_dir = Path(worker_dir) if worker_dir else WORKER_DIR
    if not (worker_dir / "CMakeLists.txt").exists():
        raise EngineError(f"{worker_dir}/CMakeLists.txt not found: the engine's CMake project is missing")
    tools = check_tools()
    if pristine:
        upstream.fetch(pin, ws)
        upstream.verify(pin, ws)
        llama_src = upstream.layout(pin, ws).pristine
    else:
        llama_src = upstream.ensure_patched(pin, ws)
    # dgr-worker's BLAKE3 C sources, pinned beside the CMake project that compiles them (a stand-in
    # project without the pin gets none)
    blake3_pin = worker_dir / "third_party" / "blake3.json"
    blake3_src = upstream.fetch_vendored(ws=ws, pin_path=blake3_pin) if blake3_pin.is_file() else None
    bdir = build_dir(lane, ws, pristine=pristine, cpu_variant=cpu_variant)
    lib = bdir / LIBRARY
    stamp_path = bdir / "dgr-build.stamp.json"
    args = cmake_args(lane, worker_dir, bdir, llama_src, blake3_src, cpu_variant) + \
        upstream_defines(pin, pristine=pristine) + [f"-D{k}={v}" for k, v in sorted((defines or {}).items())]
    inputs = _inputs(lane, pin, worker_dir, args, tools)
    # Edits in the patched tree (patch development) are invisible to the stamp: let Ninja decide.
    dirty = [] if pristine else upstream.local_changes(llama_src)
    if not force and not dirty and _up_to_date(stamp_path, lib, inputs):
        return lib
    with locked(bdir.parent / f".{bdir.name}.lock"):
        if not force and not dirty and _up_to_date(stamp_path, lib, inputs):  # built meanwhile
            return lib
        return _build(lane, bdir, lib, stamp_path, args, inputs, jobs, dirty, llama_src, progress)


def worker_enabled(bdir: Path) -> bool:
    """Whether the configured build folder `bdir` builds dgr-worker (CMake found gRPC C++ there)."""
    cache = bdir / "CMakeCache.txt"
    return cache.is_file() and "DGR_WORKER_ENABLED:INTERNAL=ON" in cache.read_text(errors="replace")


def fake_enabled(bdir: Path) -> bool:
    """Whether the configured build folder `bdir` has the fake engine's target (worker/CMakeLists.txt
    records it as DGR_FAKE_ENGINE_ENABLED; another worker folder, such as a test's stand-in, may not)."""
    cache = bdir / "CMakeCache.txt"
    return cache.is_file() and "DGR_FAKE_ENGINE_ENABLED:INTERNAL=ON" in cache.read_text(errors="replace")


def _up_to_date(stamp_path: Path, lib: Path, inputs: dict[str, Any]) -> bool:
    if not (stamp_path.exists() and lib.exists()):
        return False
    if worker_enabled(lib.parent) and not (lib.parent / WORKER_BINARY).exists():
        return False
    if fake_enabled(lib.parent) and not (lib.parent / FAKE_LIBRARY).exists():
        return False
    stamp = json.loads(stamp_path.read_text())
    return stamp.get("inputs") == inputs and stamp.get("library_blake3") == file_blake3(lib)


def _build(lane: str, bdir: Path, lib: Path, stamp_path: Path, args: list[str], inputs: dict[str, Any],
           jobs: int | None, dirty: list[str], llama_src: Path, progress: bool) -> Path:
    if dirty:
        log.warning("%s has local changes (%s...): building them, not the pinned patches",
                    llama_src, ", ".join(dirty[:3]))
    if not shutil.which("ccache"):
        log.warning("ccache not found: rebuilds will recompile everything (apt-get install ccache)")
    bdir.mkdir(parents=True, exist_ok=True)
    logfile = bdir / "dgr-build.log"
    logfile.write_text("")
    stamp_path.unlink(missing_ok=True)
    t0 = time.monotonic()
    configured = bdir / "dgr-configure.json"
    if not (bdir / "build.ninja").exists() or not configured.exists() or json.loads(configured.read_text()) != args:
        run_logged(["cmake", *args], logfile, f"configure {lane}", progress=False)
        configured.write_text(json.dumps(args))
    jobs = jobs or min(2, os.cpu_count() or 1)
    # ccache keys on paths relative to the workspace, so a second clone or workspace hits its cache.
    env = {"CCACHE_BASEDIR": str(bdir.parents[1]), **os.environ}
    targets = [TARGET] + ([FAKE_TARGET] if fake_enabled(bdir) else []) + ([WORKER_TARGET] if worker_enabled(bdir) else [])
    if WORKER_TARGET not in targets:
        log.warning("dgr-worker is not built for %s: CMake found no gRPC C++ (see %s; Debian: apt-get install "
                    "libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler)", lane, logfile)
    run_logged(["cmake", "--build", str(bdir), "-j", str(jobs), "--target", *targets], logfile,
                f"build {lane}", progress=progress, env=env)
    if not lib.exists():
        found = sorted(bdir.rglob(LIBRARY))
        where = f"; it was written to {found[0]}" if found else ""
        raise EngineError(f"the build did not produce {lib}{where}: worker/CMakeLists.txt must put target "
                          f"{TARGET} in the build folder's top level (LIBRARY_OUTPUT_DIRECTORY)")
    seconds = round(time.monotonic() - t0, 1)
    if not dirty:  # a library built from local edits is not the pinned one: no stamp, so the next call builds
        stamp_path.write_text(json.dumps({"inputs": inputs, "library_blake3": file_blake3(lib),
                                          "build_seconds": seconds}, indent=2) + "\n")
    log.info("engine (%s) built in %ss: %s", lane, seconds, lib)
    return lib


def ensure_tool(target: str, lane: str = "cpu") -> Path:
    """A helper program of worker/CMakeLists.txt that is not part of `all` (llama-simple for tests,
    dgr-hop-probe for `dgr bench frames`), built on demand in the lane's configured CMake tree (seconds once
    the engine is built, then cached by Ninja); returns its path under the tree's bin/. A failed build raises
    EngineError with the build's last lines."""
    bdir = ensure_engine(lane).parent
    # the same lock as the engine build of this folder: one Ninja at a time in it
    with locked(bdir.parent / f".{bdir.name}.lock"):
        out = subprocess.run(["cmake", "--build", str(bdir), "-j", str(min(2, os.cpu_count() or 1)), "--target", target],
                             capture_output=True, text=True, env={"CCACHE_BASEDIR": str(bdir.parents[1]), **os.environ})
    if out.returncode != 0:
        raise EngineError(f"building {target} in {bdir} failed (exit {out.returncode}):\n{(out.stdout + out.stderr)[-3000:]}")
    exe = bdir / "bin" / target
    if not exe.is_file():
        raise EngineError(f"the build did not produce {exe} (worker/CMakeLists.txt sets its output folder)")
    return exe
