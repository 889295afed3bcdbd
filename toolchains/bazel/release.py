#!/usr/bin/env python3
"""Write one lane's release: a deterministic .tar.gz of the worker and engine, and its manifest.

    release.py --lane cpu --out R.tar.gz --manifest M.json --engine libdgr_engine_cpu.so \
               --upstream dgr_upstream.json --python-root tools tools/dgr/*.py ...

The archive holds, under `dgr-<lane>/`:
    lib/libdgr_engine.so     the ShardEngine (C ABI) of the lane
    python/dgr/...           the dgr package: the worker service, its CLI, the engine binding
    bin/dgr-worker           runs `dgr worker ...` with that engine and package
    upstream.json            llama.cpp's commit, tree hash and the patch series as applied
    MANIFEST.json            size and blake3 of every other file (also written beside the archive)

Same inputs, same bytes: entries sorted, mtime 0, owner root, modes 0644/0755, gzip without a name
or time. Called by the `release_<lane>` targets (toolchains/lanes.bzl); stdlib + blake3.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import sys
import tarfile

import blake3

WORKER_SH = """#!/bin/sh
# dgr worker of this release: its own engine and Python package (Python deps: pyproject.toml of dgr).
here=$(dirname "$(readlink -f "$0")")/..
DGR_ENGINE_LIB="$here/lib/libdgr_engine.so" PYTHONPATH="$here/python${PYTHONPATH:+:$PYTHONPATH}" \\
    exec "${PYTHON:-python3}" -m dgr worker "$@"
"""


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def build(args: argparse.Namespace) -> tuple[bytes, bytes]:
    top = f"dgr-{args.lane}"
    files: dict[str, tuple[bytes, int]] = {}  # archive path -> (content, mode)
    files["lib/libdgr_engine.so"] = (_read(args.engine), 0o755)
    files["bin/dgr-worker"] = (WORKER_SH.encode(), 0o755)
    files["upstream.json"] = (_read(args.upstream), 0o644)
    root = args.python_root.rstrip("/") + "/"
    for src in args.python:
        if not src.startswith(root):
            raise SystemExit(f"release.py: {src} is not under --python-root {root}")
        files["python/" + src[len(root):]] = (_read(src), 0o644)

    upstream = json.loads(files["upstream.json"][0])
    manifest = {
        "format": 1,
        "lane": args.lane,
        "upstream": {k: upstream[k] for k in ("commit", "tree_hash", "patches")},
        "files": {
            path: {"size": len(data), "blake3": blake3.blake3(data).hexdigest()}
            for path, (data, _) in sorted(files.items())
        },
    }
    manifest_bytes = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
    files["MANIFEST.json"] = (manifest_bytes, 0o644)

    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs = sorted({os.path.dirname(p) for p in files} - {""})
        all_dirs = sorted({d.rsplit("/", i)[0] for d in dirs for i in range(d.count("/") + 1)} | {""})
        for d in all_dirs:
            info = tarfile.TarInfo(f"{top}/{d}".rstrip("/"))
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            _normalize(info)
            tar.addfile(info)
        for path, (data, mode) in sorted(files.items()):
            info = tarfile.TarInfo(f"{top}/{path}")
            info.size, info.mode = len(data), mode
            _normalize(info)
            tar.addfile(info, io.BytesIO(data))
    out = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0, compresslevel=9) as gz:
        gz.write(raw.getvalue())
    return out.getvalue(), manifest_bytes


def _normalize(info: tarfile.TarInfo) -> None:
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = "root"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="release.py")
    p.add_argument("--lane", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--manifest", required=True)
    p.add_argument("--engine", required=True)
    p.add_argument("--upstream", required=True)
    p.add_argument("--python-root", required=True)
    p.add_argument("python", nargs="*")
    args = p.parse_args(argv)
    archive, manifest = build(args)
    with open(args.out, "wb") as f:
        f.write(archive)
    with open(args.manifest, "wb") as f:
        f.write(manifest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
