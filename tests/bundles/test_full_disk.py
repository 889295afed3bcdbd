"""Full disks: `dgr recipe build` and `dgr bundle provision` into a store on a small tmpfs fail with a clear
error (what is full, how much was needed, what to do) and leave nothing that looks like a bundle."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dgr.core.constants import MANIFEST_NAME
from dgr.core.errors import StoreError
from dgr.core.hashing import file_blake3
from dgr.toolchain.bundle import build, load_bundle, provision, verify_bundle
from dgr.toolchain.synth.generic import synth

from support.fuzz import Tmpfs

PAGE = 4096


@pytest.fixture
def disk(tmp_path):
    mounts = []

    def mount(size: str) -> Tmpfs:
        t = Tmpfs(tmp_path / f"disk{len(mounts)}", size)
        mounts.append(t)
        return t

    yield mount
    for t in mounts:
        t.unmount()


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fulldisk")
    model = synth("llama", 4, 128, 1, root / "m.gguf")                  # about 3.5 MB of tensor data
    r = root / "fd.toml"
    r.write_text(f'name = "fd"\n[source]\nuri = "{model}"\nblake3 = "{file_blake3(model)}"\n'
                 f"[placement]\nstages = [[0, 2], [2, 4]]\n[bundle]\nchunk_size = 65536\n")
    return r


@pytest.fixture(scope="module")
def bundle(recipe, tmp_path_factory):
    return build(recipe, tmp_path_factory.mktemp("fdstore"))


def _no_bundle_in(store: Path) -> None:
    """Nothing a loader would take for a bundle: no NAME-ID folder, no manifest anywhere."""
    assert not list(store.rglob(MANIFEST_NAME)), list(store.rglob("*"))
    assert not [p for p in store.iterdir() if p.is_dir() and not p.name.startswith(".")]


def _clear(msg: str, store: Path) -> None:
    assert "no space left on the device" in msg and str(store) in msg, msg
    assert " bytes are free" in msg and "free some space or choose a store on a larger drive" in msg, msg


def test_build_on_a_too_small_disk_fails_before_writing(disk, recipe):
    d = disk("2m")
    store = d.path / "store"
    out = subprocess.run([sys.executable, "-m", "dgr", "recipe", "build", str(recipe), "--store", str(store),
                          "--quiet"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    _clear(out.stderr, store)
    assert "needs at least" in out.stderr and "Nothing was written" in out.stderr
    _no_bundle_in(store)
    assert not list(store.iterdir())


def test_build_that_fills_the_disk_midway_leaves_nothing(disk, recipe, bundle):
    weights = sum(s.weight_bytes for s in bundle.manifest.stages)
    d = disk("16m")
    store = d.path / "store"
    store.mkdir()
    d.fill_to(-(-weights // PAGE) * PAGE)           # room for the tensor data, not for headers and manifest
    with pytest.raises(StoreError) as e:
        build(recipe, store)
    _clear(str(e.value), store)
    assert "while writing" in str(e.value) and "Nothing of the build was kept" in str(e.value)
    _no_bundle_in(store)
    assert not list(store.iterdir()), "the partial build is removed"
    (d.path / "filler").unlink()
    b = build(recipe, store)                        # with room, the same build works
    assert b.id == bundle.id and verify_bundle(b.root, resume=False).complete


def test_provision_to_a_too_small_disk_fails_before_copying(disk, bundle):
    d = disk("2m")
    store = d.path / "store"
    out = subprocess.run([sys.executable, "-m", "dgr", "bundle", "provision", str(bundle.root), "--to", str(store),
                          "--quiet"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    _clear(out.stderr, store)
    total = sum(s.size for s in bundle.manifest.stages)
    assert f"needs {total} bytes" in out.stderr
    _no_bundle_in(store)


def test_provision_that_fills_the_disk_midway_resumes_after_room_is_made(disk, bundle):
    stages = bundle.manifest.stages
    total = sum(s.size for s in stages)
    d = disk("16m")
    store = d.path / "store"
    store.mkdir()
    filler = d.fill_to(-(-total // PAGE) * PAGE)    # the precheck passes; per-file pages and the manifest don't fit
    with pytest.raises(StoreError) as e:
        provision(bundle.root, store)
    msg = str(e.value)
    _clear(msg, store)
    assert f"needs {total} bytes" in msg and "rerun the same command to resume" in msg, msg
    _no_bundle_in(store)
    filler.unlink()
    rep = provision(bundle.root, store)
    assert rep.complete and rep.chunks_reused > 0
    copy = load_bundle(rep.dest)
    assert copy.id == bundle.id and rep.dest.name == bundle.root.name
    assert verify_bundle(copy.root, resume=False).complete
    assert [p.name for p in store.iterdir()] == [bundle.root.name]
