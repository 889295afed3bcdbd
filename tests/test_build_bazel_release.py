"""The CPU release is reproducible: two clean builds give the same bytes.

Build 1: `bazel build //:release_cpu` in a copy of this checkout, in a fresh output base (the disk
cache may serve it). Build 2: the same in a second copy at another path, in a fresh output base, with
no disk cache: every object compiled again. Timestamps (tar and gzip), absolute paths (sandbox and checkout)
and build ids (derived from the content by the linker) must not make them differ.
Slow (a full llama.cpp build): marked `slow`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import blake3
import pytest

from dgr.paths import workspace

REPO = Path(__file__).resolve().parents[1]


def bazel() -> str:
    exe = shutil.which("bazel")
    assert exe, "bazel is not installed (Debian: apt-get install bazel-bootstrap; scripts/setup does)"
    return exe


def build_release(checkout: Path, *startup: str, extra: tuple[str, ...] = ()) -> tuple[bytes, dict]:
    proc = subprocess.run(
        [bazel(), *startup, "build", *extra, "//:release_cpu"],
        cwd=checkout, capture_output=True, text=True, timeout=3600,
        # Both checkouts take llama.cpp from the same verified workspace (not the copy's own .dgr/).
        env={**os.environ, "DGR_WORKSPACE": str(workspace())},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    bin_dir = subprocess.run([bazel(), *startup, "info", *extra, "bazel-bin"], cwd=checkout,
                             env={**os.environ, "DGR_WORKSPACE": str(workspace())},
                             capture_output=True, text=True, check=True).stdout.strip()
    archive = (Path(bin_dir) / "release_cpu.tar.gz").read_bytes()
    manifest = json.loads((Path(bin_dir) / "release_cpu.MANIFEST.json").read_text())
    return archive, manifest


def tracked_copy(dest: Path) -> Path:
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO, capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


@pytest.mark.slow
def test_cpu_release_is_identical_across_two_clean_builds(tmp_path):
    # Two checkouts of one snapshot (work going on in the repository cannot slip in between).
    first = tracked_copy(tmp_path / "first")
    other = shutil.copytree(first, tmp_path / "elsewhere")
    archive1, manifest1 = build_release(first, "--batch", f"--output_base={tmp_path / 'output_base1'}")
    archive2, manifest2 = build_release(
        other, "--batch", f"--output_base={tmp_path / 'output_base2'}", extra=("--disk_cache=",)
    )
    if manifest1 != manifest2:
        diff = {p for p in manifest1["files"] if manifest1["files"][p] != manifest2["files"].get(p)}
        pytest.fail(f"the release differs between two clean builds in: {sorted(diff)}")
    assert blake3.blake3(archive1).hexdigest() == blake3.blake3(archive2).hexdigest()
    assert manifest1["files"]["lib/libdgr_engine.so"]["size"] > 1_000_000
    assert manifest1["upstream"]["patches"], "the release names the patch series it was built with"
