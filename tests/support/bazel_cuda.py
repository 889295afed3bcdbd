"""Helpers for the CUDA lane's checks (tests/builds/test_build_bazel_cuda.py and scripts/check-cuda-lane):
finding nvcc, Bazel in its own output base, and what a built shared library needs and exports."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

from dgr.core.paths import workspace

from support.paths import REPO

PROBE = "@llama_cpp//:ggml_cuda_backend_probe.so"


def find_nvcc() -> Path | None:
    for cand in (os.environ.get("CUDA_PATH", "") and os.environ["CUDA_PATH"] + "/bin/nvcc",
                 "/usr/local/cuda/bin/nvcc", shutil.which("nvcc")):
        if cand and Path(cand).exists():
            return Path(cand).resolve()
    return None


def bazel() -> str:
    exe = shutil.which("bazel")
    assert exe, "bazel is not installed (Debian: apt-get install bazel-bootstrap; scripts/setup does)"
    return exe


class Bazel:
    def __init__(self, output_base: Path):
        self.output_base = output_base

    def run(self, *args: str, timeout: int = 1800) -> subprocess.CompletedProcess:
        return subprocess.run(
            [bazel(), "--batch", f"--output_base={self.output_base}", *args],
            cwd=REPO, capture_output=True, text=True, timeout=timeout,
            env={**os.environ, "DGR_WORKSPACE": str(workspace())},
        )

    def ok(self, *args: str, timeout: int = 1800) -> subprocess.CompletedProcess:
        proc = self.run(*args, timeout=timeout)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return proc

    def toolkit(self, *flags: str) -> dict:
        """@cuda_toolkit as fetched with these flags: its toolkit.json."""
        self.ok("build", "--nobuild", *flags, "@cuda_toolkit//:cuda_runtime")
        return json.loads((self.output_base / "external/cuda_toolkit/toolkit.json").read_text())

    def bin_dir(self, *flags: str) -> Path:
        return Path(self.ok("info", *flags, "bazel-bin").stdout.strip())


def needed(lib: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def dynamic_symbols(lib: Path) -> dict[str, str]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True,
                         check=True).stdout
    return {parts[2]: parts[1] for parts in (line.split() for line in out.splitlines()) if len(parts) == 3}
