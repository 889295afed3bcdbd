"""Bazel's @llama_cpp repository rule refuses a changed patch or a changed upstream, naming it.

Runs Debian's Bazel 4 (or any Bazel on PATH) in a copy of the files the repository rule reads, in its
own output base: a control fetch passes, then one changed byte in a patch, then one changed byte in
the upstream tree, each must fail with a message naming the file. The pristine tree comes from dgr's
workspace (`dgr upstream fetch`, done by the llama_src fixture), copied, never modified in place.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from dgr.toolchain import upstream

from support.paths import REPO

# What the repository rule and the @llama_cpp BUILD file read (loading only, nothing is compiled).
RULE_INPUTS = ["WORKSPACE", ".bazelignore", "toolchains", "patches/llama.cpp", "tools/dgr/toolchain/treehash.py",
               "tools/dgr/BUILD.bazel"]


def bazel() -> str:
    exe = shutil.which("bazel")
    assert exe, "bazel is not installed (Debian: apt-get install bazel-bootstrap; scripts/setup does)"
    return exe


def mini_checkout(dest: Path) -> Path:
    for rel in RULE_INPUTS:
        src = REPO / rel
        if src.is_dir():
            shutil.copytree(src, dest / rel, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    (dest / "BUILD.bazel").write_text("")
    return dest


def workspace_copy(pristine: Path, dest: Path) -> Path:
    """A dgr workspace holding only a copy of the verified pristine tree and its listing."""
    up = dest / "upstream"
    shutil.copytree(pristine, up / pristine.name, symlinks=True)
    shutil.copy2(pristine.parent / f"{pristine.name}.listing", up / f"{pristine.name}.listing")
    return dest


def fetch(checkout: Path, output_base: Path, ws: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "DGR_WORKSPACE": str(ws)}
    return subprocess.run(
        [bazel(), "--batch", f"--output_base={output_base}", "build", "--nobuild", "@llama_cpp//:llama_headers"],
        cwd=checkout, env=env, capture_output=True, text=True, timeout=900,
    )


def flip_one_byte(path: Path, needle: bytes) -> None:
    data = path.read_bytes()
    i = data.index(needle)
    path.write_bytes(data[:i] + bytes([data[i] ^ 0x20]) + data[i + 1:])


@pytest.fixture(scope="module")
def pristine(llama_src) -> Path:
    pin = upstream.load_pin()
    tree = upstream.layout(pin).pristine
    assert tree.is_dir(), f"{tree}: missing after dgr upstream fetch"
    return tree


def test_one_changed_byte_in_a_patch_or_the_upstream_fails_the_fetch_naming_it(pristine, tmp_path):
    pin = upstream.load_pin()
    checkout = mini_checkout(tmp_path / "checkout")
    ob = tmp_path / "output_base"
    good_ws = workspace_copy(pristine, tmp_path / "ws-good")

    # Control: the unchanged inputs fetch, verify and patch.
    ok = fetch(checkout, ob, good_ws)
    assert ok.returncode == 0, ok.stderr[-3000:]

    # One byte of a patch (in its header, so that it would still apply): refused before patching.
    assert pin.patches, "the pin lists no patch: nothing to change"
    patch = checkout / pin.patches[0].file
    flip_one_byte(patch, b"Subject:")
    bad = fetch(checkout, ob, good_ws)
    assert bad.returncode != 0, "a changed patch was accepted"
    assert f"patch {pin.patches[0].file} changed" in bad.stderr, bad.stderr[-3000:]
    shutil.copy2(REPO / pin.patches[0].file, patch)

    # One byte of the upstream tree: refused by the tree hash, naming the file.
    bad_ws = workspace_copy(pristine, tmp_path / "ws-bad")
    flip_one_byte(bad_ws / "upstream" / pristine.name / "src/llama.cpp", b"llama_")
    bad = fetch(checkout, ob, bad_ws)
    assert bad.returncode != 0, "a changed upstream tree was accepted"
    assert "does not match the pin's tree hash" in bad.stderr, bad.stderr[-3000:]
    assert "src/llama.cpp: content changed" in bad.stderr, bad.stderr[-3000:]

    # And back: the restored inputs fetch again (the failures were the byte, nothing else).
    ok = fetch(checkout, ob, good_ws)
    assert ok.returncode == 0, ok.stderr[-3000:]
