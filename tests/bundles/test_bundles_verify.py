"""Verify and provision: corruption is found and named, interrupted runs resume without re-reading."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dgr.cli.main import main
from dgr.core.constants import MANIFEST_NAME
from dgr.core.errors import BundleError, StoreError
from dgr.core.hashing import file_blake3
from dgr.toolchain.bundle import build, load_bundle, provision, verify_bundle
from dgr.toolchain.bundle.verify import _state_path
from dgr.toolchain.synth.generic import synth


def make_bundle(root: Path, *, layers: int = 4, embd: int = 64, chunk: int = 4096, name: str = "v"):
    model = synth("llama", layers, embd, 1, root / f"{name}.gguf")
    r = root / f"{name}.toml"
    half = layers // 2
    r.write_text(f'''name = "{name}"
[source]
uri = "{model.name}"
blake3 = "{file_blake3(model)}"
[placement]
stages = [[0, {half}], [{half}, {layers}]]
[bundle]
chunk_size = {chunk}
''')
    return build(r, root / "store")


def test_verify_ok_then_flipped_byte_anywhere_is_named(tmp_path):
    b = make_bundle(tmp_path)
    rep = verify_bundle(b.root)
    assert rep.complete and rep.chunks_read == rep.chunks_total == sum(len(s.chunks) for s in b.manifest.stages)
    rng = random.Random(7)
    for s in b.manifest.stages:
        p = b.root / s.file
        for offset in (0, rng.randrange(s.size), s.size - 1):
            data = bytearray(p.read_bytes())
            data[offset] ^= 0x01
            p.write_bytes(bytes(data))
            with pytest.raises(BundleError) as e:
                verify_bundle(b.root, resume=False)
            k = offset // b.manifest.chunk_size
            assert f"{s.file}: chunk {k} " in str(e.value) and "corrupt" in str(e.value)
            data[offset] ^= 0x01
            p.write_bytes(bytes(data))
    assert verify_bundle(b.root, resume=False).complete


def test_verify_truncated_and_deleted_files_are_named(tmp_path, capsys):
    b = make_bundle(tmp_path)
    p = b.stage_paths[1]
    full = p.read_bytes()
    p.write_bytes(full[:-100])
    assert main(["bundle", "verify", str(b.root), "-q"]) != 0
    err = capsys.readouterr().err
    assert p.name in err and "truncated" in err and f"first bad chunk {(len(full) - 100) // 4096}" in err
    p.unlink()
    assert main(["bundle", "verify", str(b.root), "-q"]) != 0
    err = capsys.readouterr().err
    assert p.name in err and "missing" in err
    p.write_bytes(full)
    assert main(["bundle", "verify", str(b.root), "-q"]) == 0
    assert b.id in capsys.readouterr().out


def test_verify_resumes_where_it_stopped(tmp_path):
    b = make_bundle(tmp_path)
    total = sum(len(s.chunks) for s in b.manifest.stages)
    first = verify_bundle(b.root, max_chunks=total // 2 + 3)
    assert not first.complete and first.chunks_read == total // 2 + 3
    second = verify_bundle(b.root)
    assert second.complete
    assert second.chunks_skipped == first.chunks_read
    assert second.chunks_read == total - first.chunks_read
    # a finished check starts afresh next time
    assert verify_bundle(b.root).chunks_read == total


def test_verify_of_one_stage_reads_its_file_alone_and_resumes(tmp_path, capsys):
    # what a pod's init container runs before its worker (docs/deploy.md "Kubernetes"): its own stage only
    b = make_bundle(tmp_path)
    n1 = len(b.manifest.stages[1].chunks)
    p0 = b.stage_paths[0]
    data = bytearray(p0.read_bytes())
    data[0] ^= 0x01
    p0.write_bytes(bytes(data))                       # stage 0 corrupt: not stage 1's business
    first = verify_bundle(b.root, stages=[1], max_chunks=n1 // 2)
    assert not first.complete and first.chunks_total == n1
    rest = verify_bundle(b.root, stages=[1])
    assert rest.complete and rest.chunks_skipped == n1 // 2 and rest.chunks_read == n1 - n1 // 2
    assert main(["bundle", "verify", str(b.root), "--stage", "1", "--expect-id", b.id[:12], "-q"]) == 0
    assert f"{n1} chunks of stage(s) 1 verified" in capsys.readouterr().out
    with pytest.raises(BundleError, match=f"{b.manifest.stages[0].file}: chunk 0 "):
        verify_bundle(b.root, stages=[0, 1])
    assert main(["bundle", "verify", str(b.root), "--stage", "2", "-q"]) != 0
    assert "no stage 2: the bundle's stages are 0-1" in capsys.readouterr().err


def test_verify_rechecks_a_file_changed_since_the_interrupted_run(tmp_path):
    b = make_bundle(tmp_path)
    n0 = len(b.manifest.stages[0].chunks)
    verify_bundle(b.root, max_chunks=n0 - 1)  # stage 0 mostly verified
    p = b.stage_paths[0]
    data = bytearray(p.read_bytes())
    data[10] ^= 0xFF  # corrupt a chunk that was already verified; the mtime changes
    p.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=rf"{p.name}: chunk 0 "):
        verify_bundle(b.root)


def _state_of(pid: int) -> str:
    """A process's state letter (/proc/PID/stat: R, S, T for stopped, ...); "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return ""


def test_verify_resumes_after_kill(tmp_path):
    b = make_bundle(tmp_path, layers=8, embd=256, chunk=16384)
    total = sum(len(s.chunks) for s in b.manifest.stages)
    state = _state_path(load_bundle(b.root), "verify")
    state.unlink(missing_ok=True)
    # the verifier stops itself right after its 40th chunk is recorded (DGR_TEST_VERIFY_STOP_AFTER), and is
    # killed there: the kill lands mid-verify by construction, however fast or slow this machine is
    proc = subprocess.Popen([sys.executable, "-m", "dgr", "bundle", "verify", str(b.root), "-q"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "DGR_TEST_VERIFY_STOP_AFTER": "40"})
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and _state_of(proc.pid) != "T":
            time.sleep(0.01)
        assert _state_of(proc.pid) == "T", "the verifier did not stop at its 40th chunk"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    recorded = sum(r["chunks_ok"] for r in json.loads(state.read_text()).values())
    assert recorded == 40 < total
    rep = verify_bundle(b.root)
    assert rep.complete and rep.chunks_skipped == recorded and rep.chunks_read == total - recorded


def test_provision_copies_verifies_and_resumes(tmp_path):
    b = make_bundle(tmp_path)
    total = sum(len(s.chunks) for s in b.manifest.stages)
    part = provision(b.root, tmp_path / "drive", max_chunks=total // 3)
    assert not part.complete and part.chunks_copied == total // 3
    assert not (part.dest / MANIFEST_NAME).exists(), "no manifest until every stage is in place"
    rest = provision(b.root, tmp_path / "drive")
    assert rest.complete and rest.chunks_reused == total // 3 and rest.chunks_copied == total - total // 3
    copy = load_bundle(rest.dest)
    assert copy.id == b.id
    for p, q in zip(b.stage_paths, copy.stage_paths):
        assert p.read_bytes() == q.read_bytes()
    assert verify_bundle(rest.dest).complete
    again = provision(b.root, tmp_path / "drive")  # idempotent: nothing copied twice
    assert again.chunks_copied == 0 and again.chunks_reused == total


def test_provision_refuses_corrupt_source_and_home(tmp_path, capsys):
    b = make_bundle(tmp_path)
    p = b.stage_paths[1]
    data = bytearray(p.read_bytes())
    data[5000] ^= 0x10
    p.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=rf"{p.name}: chunk 1 .*source bundle is corrupt"):
        provision(b.root, tmp_path / "drive")
    assert not list((tmp_path / "drive").glob(f"*/{MANIFEST_NAME}"))
    with pytest.raises(StoreError, match="under /home"):
        provision(b.root, "/home/alice/store")
    assert main(["bundle", "provision", str(b.root), "--to", "/home/x"]) != 0
    assert "under /home" in capsys.readouterr().err
