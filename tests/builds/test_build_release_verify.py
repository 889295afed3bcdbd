"""Release archives: deterministic bytes, and `dgr release verify` names any file that differs.

Uses the release writer of the Bazel targets (toolchains/bazel/release.py) on small inputs, so it
runs in seconds; the full CPU release is checked in tests/builds/test_build_bazel_release.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import tarfile
from pathlib import Path

import pytest

from dgr.cli.main import main
from dgr.core.errors import ReleaseError
from dgr.toolchain.release import verify_release

from support.paths import REPO


def release_writer():
    spec = importlib.util.spec_from_file_location("release", REPO / "toolchains/bazel/release.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tiny_wheel(tmp: Path) -> Path:
    """A wheel of one module and one file under .data/purelib (both land in python/)."""
    import zipfile

    path = tmp / "tinydep-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("tinydep/__init__.py", "VALUE = 1\n")
        z.writestr("tinydep-1.0.data/purelib/tinydep_extra.py", "EXTRA = 2\n")
        z.writestr("tinydep-1.0.data/scripts/tinydep-cli", "#!/bin/sh\n")
        z.writestr("tinydep-1.0.dist-info/METADATA", "Name: tinydep\nVersion: 1.0\n")
    return path


def inputs(tmp: Path) -> argparse.Namespace:
    (tmp / "tools/dgr/cli").mkdir(parents=True)
    (tmp / "tools/dgr/__init__.py").write_text('__version__ = "9.8.7"\n')
    (tmp / "tools/dgr/cli/main.py").write_text("def main():\n    return 0\n")
    (tmp / "libdgr_engine.so").write_bytes(b"\x7fELF" + bytes(range(256)) * 4)
    (tmp / "dgr-worker").write_bytes(b"\x7fELF" + bytes(range(255, -1, -1)) * 4)
    (tmp / "up.json").write_text(json.dumps({"commit": "c" * 40, "tree_hash": "t" * 64, "patches": []}))
    wheel = tiny_wheel(tmp)
    (tmp / "lock.json").write_text(json.dumps({"format": 1, "python": "cp311", "wheels": [
        {"name": "tinydep", "version": "1.0", "file": wheel.name, "sha256": "0" * 64}]}))
    from dgr.app.workerbin import worker_binary

    return argparse.Namespace(
        # the digests come from a real dgr-worker's --blake3 (release.py is stdlib only); the packed one is a stand-in
        b3sum=str(worker_binary()),
        lane="cpu", engine=str(tmp / "libdgr_engine.so"), worker=str(tmp / "dgr-worker"), upstream=str(tmp / "up.json"),
        python_root=str(tmp / "tools"), lock=str(tmp / "lock.json"), wheel=[str(wheel)],
        python=[str(tmp / "tools/dgr/__init__.py"), str(tmp / "tools/dgr/cli/main.py")],
    )


def rewrite(archive: bytes, change) -> bytes:
    """The archive with `change(name, data) -> data | None` applied to each file (None drops it)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as src, \
            tarfile.open(fileobj=out, mode="w:gz") as dst:
        for m in src.getmembers():
            data = src.extractfile(m).read() if m.isfile() else None
            if data is not None:
                data = change(m.name, data)
                if data is None:
                    continue
                m.size = len(data)
            dst.addfile(m, io.BytesIO(data) if data is not None else None)
    return out.getvalue()


def test_same_inputs_give_the_same_bytes_and_the_manifest_hashes_every_file(tmp_path):
    rel = release_writer()
    args = inputs(tmp_path)
    a1, m1 = rel.build(args)
    (tmp_path / "tools/dgr/cli/main.py").touch()  # a new mtime changes nothing
    a2, m2 = rel.build(args)
    assert a1 == a2 and m1 == m2
    files = json.loads(m1)["files"]
    # the wheel's importable files are unpacked into python/ (its scripts are not: a worker needs none)
    assert set(files) == {"lib/libdgr_engine.so", "bin/dgr-worker", "bin/dgr", "upstream.json", "release.json",
                          "python/dgr/__init__.py", "python/dgr/cli/main.py", "python/tinydep/__init__.py",
                          "python/tinydep_extra.py", "python/tinydep-1.0.dist-info/METADATA"}
    path = tmp_path / "r.tar.gz"
    path.write_bytes(a1)
    manifest = verify_release(path)
    assert (manifest["lane"], manifest["version"], manifest["python"]) == ("cpu", "9.8.7", "cp311")
    with tarfile.open(path) as tar:
        release = json.loads(tar.extractfile("dgr-cpu/release.json").read())
        worker = tar.extractfile("dgr-cpu/bin/dgr-worker")
        assert worker.read() == (tmp_path / "dgr-worker").read_bytes()       # the C++ worker itself
        assert tar.getmember("dgr-cpu/bin/dgr-worker").mode == 0o755
        launcher = tar.extractfile("dgr-cpu/bin/dgr").read().decode()
    assert release["wheels"] == ["tinydep==1.0"] and release["version"] == "9.8.7"
    assert '-S -m dgr "$@"' in launcher and 'PYTHONPATH="$here/python"' in launcher
    assert main(["release", "verify", str(path)]) == 0


def test_a_wheel_that_is_not_the_locks_is_refused(tmp_path):
    args = inputs(tmp_path)
    args.wheel = []
    with pytest.raises(SystemExit, match="not the lock's: missing"):
        release_writer().build(args)


@pytest.mark.parametrize("case", ["changed", "removed", "added"])
def test_verify_names_the_file_that_differs(tmp_path, case):
    archive, _ = release_writer().build(inputs(tmp_path))
    target = "dgr-cpu/lib/libdgr_engine.so"

    def change(name, data):
        if name == target and case == "changed":
            return data[:10] + bytes([data[10] ^ 1]) + data[11:]
        if name == target and case == "removed":
            return None
        return data

    bad = rewrite(archive, change)
    if case == "added":
        out = io.BytesIO()
        with tarfile.open(fileobj=io.BytesIO(bad), mode="r:gz") as src, tarfile.open(fileobj=out, mode="w:gz") as dst:
            for m in src.getmembers():
                dst.addfile(m, src.extractfile(m) if m.isfile() else None)
            extra = tarfile.TarInfo("dgr-cpu/lib/extra.so")
            extra.size = 3
            dst.addfile(extra, io.BytesIO(b"abc"))
        bad, target = out.getvalue(), "dgr-cpu/lib/extra.so"
    path = tmp_path / "bad.tar.gz"
    path.write_bytes(bad)
    with pytest.raises(ReleaseError, match=target.replace(".", r"\.")):
        verify_release(path)
    assert main(["release", "verify", str(path)]) != 0
