"""The real pin end to end: the PyPI sdist fetched with pip, its sha256 and tree hash checked, patched.

Slow the first time (a 77 MB download and extraction); the workspace keeps the result, so later
sessions reuse it. The fresh-workspace test always downloads (pip's own cache may serve it).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from dgr.core.hashing import file_sha256
from dgr.toolchain import treehash, upstream

from support.upstream import TREEHASH_SCRIPT

pytestmark = pytest.mark.slow


def test_the_workspace_holds_the_verified_patched_pin(llama_src):
    pin = upstream.load_pin()
    assert upstream.verify(pin) == pin.tree_hash
    st = upstream.status(pin)
    assert st["fetched"] and st["verified"] and st["patches_current"]
    assert st["patched"] == str(llama_src)
    assert [p.file for p in pin.patches] == st["patches_applied"]
    # DeepSeek V4 is in this commit: the tree is really b11312.
    assert (llama_src / "src" / "models" / "deepseek4.cpp").is_file()
    assert (llama_src / "include" / "llama.h").is_file()
    # Bazel and Nix call the script on the pristine tree: it agrees.
    pristine = upstream.layout(pin).pristine
    ok = subprocess.run([sys.executable, "-I", str(TREEHASH_SCRIPT), str(pristine), "--expect", pin.tree_hash],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr


def test_fresh_workspace_fetches_the_sdist_with_pip(tmp_path):
    pin = upstream.load_pin()
    sdist = next(s for s in pin.sources if s.kind == "pypi-sdist")
    src = upstream.fetch(pin, tmp_path)
    archive = tmp_path / "cache" / "downloads" / sdist.filename
    assert file_sha256(archive) == sdist.sha256
    assert treehash.tree_hash(src) == pin.tree_hash
    assert upstream.status(pin, tmp_path)["source"] == sdist.describe()
