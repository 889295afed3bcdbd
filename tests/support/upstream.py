"""A tiny real upstream for the upstream tests: a source tree, its tarball served over loopback HTTP
(with Range support, so resume is exercised), a stand-in repository holding a pin and patches made
with `git format-patch`. Imported by the test_upstream_* files (fixtures included).
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest

from dgr.core.hashing import file_sha256
from dgr.toolchain import treehash, upstream

from support.paths import REPO

TREEHASH_SCRIPT = REPO / "tools" / "dgr" / "toolchain" / "treehash.py"
FAKE_COMMIT = "ab" * 20  # the tiny upstream's "commit" (any 40 hex)

TINY_FILES = {
    "CMakeLists.txt": "# tiny upstream\n",
    "include/llama.h": "#pragma once\n#define TINY_LLAMA_VALUE 41\n",
    "src/llama.cpp": "#include \"llama.h\"\nint tiny_llama(void) { return TINY_LLAMA_VALUE; }\n",
    "ggml/src/ggml.c": "int ggml_tiny(void) { return 1; }\n",
    "ggml/src/ggml-vulkan/ggml-vulkan.cpp": "int ggml_vk_tiny(void) { return 2; }\n",
    "tools/run.sh": "#!/bin/sh\necho run\n",
    # Not build-relevant: must not count for the tree hash nor land in the pristine tree.
    "README.md": "# readme\n",
    "docs/build.md": "how to build\n",
    "src/.gitignore": "*.o\n",
    "tools/ui/static/favicon.svg": "<svg/>\n",
    "models/ggml-vocab-x.gguf": "GGUF....\n",
}
# The build-relevant ones, in listing order: what the tree hash covers and the pristine tree holds.
BUILD_FILES = ["CMakeLists.txt", "ggml/src/ggml-vulkan/ggml-vulkan.cpp", "ggml/src/ggml.c", "include/llama.h",
               "src/llama.cpp", "tools/run.sh"]


def make_tree(root: Path, files: dict[str, str] | None = None) -> Path:
    for rel, text in (files or TINY_FILES).items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        if rel.endswith(".sh"):
            p.chmod(0o755)
    return root


def make_tarball(tree: Path, prefix: str, out: Path) -> Path:
    with tarfile.open(out, "w:gz") as tar:
        tar.add(tree, arcname=prefix)
    return out


def git(cwd: Path, *args: str) -> str:
    env = {**os.environ, **upstream.GIT_ENV}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout


def format_patch(tree: Path, edits: list[tuple[str, dict[str, str]]], out_dir: Path) -> list[Path]:
    """Commit each (subject, {file: new text}) on a git copy of `tree`; export with git format-patch."""
    work = out_dir.parent / ".patchwork"
    subprocess.run(["cp", "-a", str(tree), str(work)], check=True)
    git(work, "init", "-q")
    git(work, "add", "-A")
    git(work, "commit", "-q", "-m", "base")
    for subject, changes in edits:
        for rel, text in changes.items():
            (work / rel).write_text(text)
        git(work, "commit", "-q", "-am", f"{subject}\n\nWhy: a hook the tests need.")
    out_dir.mkdir(parents=True, exist_ok=True)
    names = git(work, "format-patch", "--zero-commit", "--no-signature", "-o", str(out_dir),
                f"HEAD~{len(edits)}..HEAD").split()
    subprocess.run(["rm", "-rf", str(work)], check=True)
    return [Path(n) for n in names]


class RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Serves files from `directory`, honouring `Range: bytes=N-`; records the requests it saw."""

    seen: list[tuple[str, str | None]] = []

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        RangeHandler.seen.append((self.path, self.headers.get("Range")))
        path = Path(self.translate_path(self.path))
        if not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes="):
            start = int(rng[6:].split("-")[0])
            if start >= len(data):
                self.send_response(416)
                self.end_headers()
                return
            body = data[start:]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            body = data
            self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def http_dir(tmp_path):
    """(directory served, base URL); RangeHandler.seen lists the requests."""
    served = tmp_path / "served"
    served.mkdir()
    handler = lambda *a, **k: RangeHandler(*a, directory=str(served), **k)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    RangeHandler.seen = []
    yield served, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def write_pin(repo: Path, sources: list[dict], tree_hash: str | None, patches: list | None = None) -> Path:
    pin = repo / "toolchains" / "llama.cpp.pin.json"
    pin.parent.mkdir(parents=True, exist_ok=True)
    (repo / "patches" / "llama.cpp").mkdir(parents=True, exist_ok=True)
    pin.write_text(json.dumps({"name": "llama.cpp", "release": "tiny", "commit": FAKE_COMMIT,
                               "sources": sources, "tree_hash": tree_hash, "patches": patches or []}, indent=2))
    return pin


@pytest.fixture
def tiny(tmp_path, http_dir):
    """A tiny upstream served over HTTP and a stand-in repository pinning it: a dict of paths/values."""
    served, base = http_dir
    tree = make_tree(tmp_path / "tree")
    prefix = f"llama.cpp-{FAKE_COMMIT}"
    tarball = make_tarball(tree, prefix, served / "tiny.tar.gz")
    repo = tmp_path / "repo"
    source = {"kind": "archive", "url": f"{base}/tiny.tar.gz", "sha256": file_sha256(tarball),
              "strip_prefix": prefix}
    pin = write_pin(repo, [source], treehash.tree_hash(tree))
    return {"tree": tree, "served": served, "base": base, "tarball": tarball, "repo": repo, "pin": pin,
            "source": source, "ws": tmp_path / "ws", "prefix": prefix}
