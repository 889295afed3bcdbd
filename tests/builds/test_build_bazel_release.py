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

from dgr.core.paths import workspace

from support.paths import REPO


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


PROMPT = "The three primary colors are"


def _serving_address(proc: subprocess.Popen, timeout: float) -> str:
    """The HOST:PORT a worker prints once it serves (it exits, or says nothing, on failure)."""
    import re
    import time

    deadline = time.monotonic() + timeout
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"serving on (\S+:\d+)", line)
        if m:
            return m.group(1)
    proc.kill()
    pytest.fail("a release worker did not start:\n" + "".join(lines) + proc.stdout.read())


@pytest.mark.slow
@pytest.mark.engine
def test_release_serves_where_no_python3_exists_and_its_dgr_runs_on_a_bare_python(tmp_path, engine_lib, smollm2_gguf):
    """The CPU release, extracted into an empty folder: its `bin/dgr-worker` serves the 3 stages of SmolLM2
    with no python3 on PATH and a clean environment (no checkout, nothing of the workspace), and a route
    through them, one through the checkout's own workers, and one mixing the two (a release's stage 0, the
    checkout's 1 and 2: one numerics, docs/numerics.md) all generate the whole model's tokens and logits,
    bit for bit. `bin/dgr --version`, run by the
    system's bare /usr/bin/python3 (no PYTHONPATH, no site-packages: only what the archive carries),
    reports the release's own pin."""
    import shutil
    import tarfile
    import time

    import numpy as np

    from dgr.app.demo import ensure_bundle, whole_model_run
    from dgr.app.local import LocalRoute
    from dgr.runtime.engine import Engine
    from dgr.runtime.wire.client import RouteClient
    from dgr.toolchain.buildinfo import build_info

    proc = subprocess.run([bazel(), "build", "//:release_cpu"], cwd=REPO, capture_output=True, text=True,
                          timeout=3600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    bin_dir = subprocess.run([bazel(), "info", "bazel-bin"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.strip()
    archive = Path(bin_dir) / "release_cpu.tar.gz"
    dest = tmp_path / "opt"
    dest.mkdir()
    with tarfile.open(archive) as tar:
        tar.extractall(dest)
    top = dest / "dgr-cpu"
    assert (top / "bin/dgr-worker").read_bytes()[:4] == b"\x7fELF", "bin/dgr-worker is the C++ worker"
    if Path("/usr/bin/python3").exists():
        env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path / "home"), "PYTHON": "/usr/bin/python3",
               "DGR_WORKSPACE": str(tmp_path / "state")}
        version = subprocess.run([str(top / "bin/dgr"), "--version"], env=env, cwd=tmp_path, capture_output=True,
                                 text=True, timeout=120)
        assert version.returncode == 0, version.stderr
        info = build_info()
        assert version.stdout.startswith(f"dgr {info.version} (release cpu, Python deps cp311)")
        assert f"llama.cpp {info.commit}" in version.stdout and info.patch_series in version.stdout

    empty = tmp_path / "no-python"                      # a PATH where no python3 (nor anything else) is
    empty.mkdir()
    env = {"PATH": str(empty), "HOME": str(tmp_path / "home")}
    assert shutil.which("python3", path=env["PATH"]) is None

    bundle = ensure_bundle(3, progress=False)[0]
    t0 = time.monotonic()
    procs = [subprocess.Popen([str(top / "bin/dgr-worker"), "serve", "--bundle", str(bundle.root), "--stage", str(i),
                               "--listen", "127.0.0.1:0", "--threads", "1", "--n-ctx", "512"], env=env, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(3)]
    args = [["--bundle", str(bundle.root), "--stage", str(i), "--threads", "1", "--n-ctx", "512"] for i in range(3)]
    try:
        addresses = [_serving_address(p, 300) for p in procs]
        to_serving = time.monotonic() - t0
        print(f"release: 3 workers from the extracted archive to SERVING in {to_serving:.1f} s")
        with RouteClient(addresses) as c:
            release_gen = c.run(PROMPT, max_new_tokens=16, logits="last", stop_token_ids=[])
        with LocalRoute(args, env={"DGR_ENGINE_LIB": str(engine_lib)}, timeout=300) as r:
            with RouteClient(r.addresses) as c:
                checkout_gen = c.run(PROMPT, max_new_tokens=16, logits="last", stop_token_ids=[])
            # one numerics (docs/numerics.md): a release's worker and a checkout's share a route, and it is exact
            mixed_route = [addresses[0], r.addresses[1], r.addresses[2]]
            with RouteClient(mixed_route) as c:
                mixed_gen = c.run(PROMPT, max_new_tokens=16, logits="last", stop_token_ids=[])
                numerics = c.numerics
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=60)
    assert len(set(numerics)) == 1 and numerics[0].startswith("cpu/x86-64-v3 "), numerics
    ids = release_gen.prompt_ids
    eng = Engine.open(smollm2_gguf, lib=engine_lib, n_threads=1, n_ctx=512)
    try:
        whole = whole_model_run(eng, ids, 16)
    finally:
        eng.close()
    for gen in (release_gen, checkout_gen, mixed_gen):
        assert gen.token_ids == whole.token_ids
        rows = [gen.logits[len(ids) - 1 + k] for k in range(16)]
        assert all(np.array_equal(a, b) for a, b in zip(rows, whole.logits)), \
            f"max |logit diff| {max(float(np.max(np.abs(a - b))) for a, b in zip(rows, whole.logits))}"
    assert release_gen.text == checkout_gen.text and release_gen.text
