"""dgr-worker checks its stage file against the bundle manifest before loading it (docs/worker.md, "Stage file
check"): chunk by chunk with the official BLAKE3 C implementation (pinned: worker/third_party/blake3.json), the
first bad chunk named in the Python verifier's words (dgr.toolchain.bundle.verify_bundle), before the engine library is
even loaded. Real files, a real dgr-worker process; the bundle is a tiny synthetic one built with 4 KiB chunks,
so a stage file spans many chunks.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import blake3
import numpy as np
import pytest

from dgr.core.errors import BundleError
from dgr.toolchain.bundle import build, load_bundle, verify_bundle

from support.engine import b3, synth_model

CHUNK = 4096
READY = re.compile(r"serving on (\S+)")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A 2-stage bundle of a tiny llama, in 4 KiB verification chunks (built once; tests work on copies)."""
    d = tmp_path_factory.mktemp("verify")
    src = synth_model(d, "llama", layers=4)
    recipe = d / "v.toml"
    recipe.write_text(f'name = "v"\n\n[source]\nuri = "{src}"\nblake3 = "{b3(src)}"\n\n'
                      f"[placement]\nstages = [[0, 2], [2, 4]]\n\n[bundle]\nchunk_size = {CHUNK}\n")
    root = build(recipe, d / "store").root
    assert all(len(s.chunks) > 8 for s in load_bundle(root).manifest.stages)
    return root


@pytest.fixture
def bundle(built, tmp_path) -> Path:
    dest = tmp_path / built.name
    shutil.copytree(built, dest)
    return dest


def stage_file(bundle: Path, stage: int) -> Path:
    return bundle / load_bundle(bundle).manifest.stages[stage].file


def refused(worker_bin: Path, bundle: Path, stage: int, tmp_path: Path, *extra: str) -> str:
    """dgr-worker's one-line refusal, with no engine library anywhere (a check after the load would say so)."""
    env = {**os.environ, "DGR_ENGINE_LIB": str(tmp_path / "no-engine.so")}
    r = subprocess.run([str(worker_bin), "--bundle", str(bundle), "--stage", str(stage), "--listen", "127.0.0.1:0",
                        *extra], capture_output=True, text=True, env=env, timeout=60)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 1 and len(lines) == 1, (r.returncode, r.stdout, r.stderr)
    assert "no engine library" not in lines[0]
    return lines[0].removeprefix("dgr-worker: error: ")


def python_says(bundle: Path) -> str:
    with pytest.raises(BundleError) as e:
        verify_bundle(bundle, resume=False)
    return str(e.value)


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_a_tampered_chunk_is_refused_by_name_before_the_engine_loads(worker_bin, bundle, tmp_path):
    f = stage_file(bundle, 1)
    flip(f, 3 * CHUNK + 123)
    line = refused(worker_bin, bundle, 1, tmp_path)
    assert line == (f"{f}: chunk 3 (bytes {3 * CHUNK}-{4 * CHUNK - 1}) does not match the manifest: the file is corrupt; "
                    "re-provision the bundle")
    assert line == python_says(bundle)              # the Python verifier's words, to the byte
    # the other stage is intact: it passes the check and stops at the missing engine library
    env = {**os.environ, "DGR_ENGINE_LIB": str(tmp_path / "no-engine.so")}
    r = subprocess.run([str(worker_bin), "--bundle", str(bundle), "--stage", "0"], capture_output=True, text=True,
                       env=env, timeout=60)
    assert r.returncode == 1 and "no engine library at" in r.stderr and "match the manifest" in r.stdout


def test_the_last_partial_chunk_is_checked_too(worker_bin, bundle, tmp_path):
    f = stage_file(bundle, 0)
    size = f.stat().st_size
    k = (size - 1) // CHUNK
    flip(f, size - 1)
    line = refused(worker_bin, bundle, 0, tmp_path)
    assert line == f"{f}: chunk {k} (bytes {k * CHUNK}-{size - 1}) does not match the manifest: the file is corrupt; " \
                   "re-provision the bundle"
    assert line == python_says(bundle)


def test_a_truncated_long_or_missing_file_is_refused_by_name(worker_bin, bundle, tmp_path):
    f = stage_file(bundle, 0)
    size = f.stat().st_size
    os.truncate(f, size - 5000)
    line = refused(worker_bin, bundle, 0, tmp_path)
    k = (size - 5000) // CHUNK
    assert line == (f"{f}: size {size - 5000} bytes, manifest says {size}: the file is truncated; first bad chunk {k} "
                    f"(bytes {k * CHUNK}-); re-provision the bundle")
    assert line == python_says(bundle)
    # --no-verify skips the hashing, never the size check
    assert refused(worker_bin, bundle, 0, tmp_path, "--no-verify") == line

    os.truncate(f, size + 1)
    line = refused(worker_bin, bundle, 0, tmp_path)
    assert f"{f}: size {size + 1} bytes, manifest says {size}: the file is too long" in line
    assert line == python_says(bundle)

    f.unlink()
    line = refused(worker_bin, bundle, 0, tmp_path)
    assert line == f"{f}: stage 0 file is missing; re-provision the bundle"
    assert line == python_says(bundle)


def test_no_verify_skips_only_the_hashing(worker_bin, bundle, tmp_path):
    """`dgr worker serve` verifies the bundle itself (resumably) and may pass --no-verify: then a changed
    chunk is not looked for, and the worker goes on to load the engine (here: missing)."""
    flip(stage_file(bundle, 1), 5)
    env = {**os.environ, "DGR_ENGINE_LIB": str(tmp_path / "no-engine.so")}
    r = subprocess.run([str(worker_bin), "--bundle", str(bundle), "--stage", "1", "--no-verify"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 1 and "no engine library at" in r.stderr and "match the manifest" not in r.stdout


def test_an_intact_bundle_is_checked_then_served(worker_bin, built):
    p = subprocess.Popen([str(worker_bin), "--bundle", str(built), "--stage", "1", "--listen", "127.0.0.1:0"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = []
    try:
        for line in p.stdout:
            log.append(line)
            if READY.search(line):
                break
        text = "".join(log)
        n = len(load_bundle(built).manifest.stages[1].chunks)
        assert READY.search(text), text
        assert re.search(rf"{re.escape(str(stage_file(built, 1)))}: {n} chunk\(s\), \d+ bytes match the manifest", text)
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 0


def test_the_c_blake3_equals_the_python_package(worker_bin, tmp_path):
    """Lengths around BLAKE3's 1 KiB chunks, its 64-byte blocks and the SIMD batches (up to 16 chunks), and a
    few MiB: `dgr-worker --blake3 FILE` against Python's `blake3`."""
    rng = np.random.default_rng(21)
    lengths = [0, 1, 63, 64, 65, 1023, 1024, 1025, 2047, 2048, 2049, 3 * 1024 + 1, 4096, 8 * 1024 - 1, 8 * 1024 + 1,
               16 * 1024 - 1, 16 * 1024, 16 * 1024 + 1, 31 * 1024 + 7, 64 * 1024, 64 * 1024 + 1, 100_003,
               (1 << 20) + 1025, 3 * (1 << 20) + 17]
    files, want = [], {}
    for n in lengths:
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        p = tmp_path / f"in-{n}.bin"
        p.write_bytes(data)
        files += ["--blake3", str(p)]
        want[str(p)] = blake3.blake3(data).hexdigest()
    out = subprocess.run([str(worker_bin), *files], capture_output=True, text=True, timeout=60, check=True).stdout
    got = dict(reversed(line.split("  ", 1)) for line in out.splitlines())
    assert got == want


def test_the_pinned_blake3_sources_are_checked_file_by_file(tmp_path):
    """dgr.toolchain.upstream.vendored: the archive the pin names (sha256), then each pinned file's blake3; a file that
    differs is refused by name, and a changed file in the workspace is extracted again."""
    from dgr.core.errors import UpstreamError
    from dgr.core.paths import workspace
    from dgr.toolchain.upstream import fetch_vendored, load_vendored_pin

    pin = load_vendored_pin()
    archive = fetch_vendored(pin).parent.parent / "cache" / "downloads" / f"{pin.key}.tar.gz"
    assert archive.is_file() and archive.is_relative_to(workspace())
    ws = tmp_path / "ws"
    (ws / "cache" / "downloads").mkdir(parents=True)
    shutil.copy(archive, ws / "cache" / "downloads" / archive.name)       # no download: the cached archive
    bad = pin.model_copy(update={"files": {**pin.files, "blake3.c": "0" * 64}, "sources": pin.sources[:1]})
    with pytest.raises(UpstreamError, match=r"blake3\.c has blake3 [0-9a-f]{64}, the pin says 0{64}"):
        fetch_vendored(bad, ws=ws)
    src = fetch_vendored(pin.model_copy(update={"sources": pin.sources[:1]}), ws=ws)
    assert sorted(p.name for p in src.iterdir()) == sorted(pin.files)
    (src / "blake3.c").write_text("tampered\n")
    assert fetch_vendored(pin.model_copy(update={"sources": pin.sources[:1]}), ws=ws) == src
    assert blake3.blake3((src / "blake3.c").read_bytes()).hexdigest() == pin.files["blake3.c"]
