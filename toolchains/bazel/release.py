#!/usr/bin/env python3
"""Write one lane's release: a deterministic .tar.gz of the worker and engine, and its manifest.

    release.py --lane cpu --out R.tar.gz --manifest M.json --engine libdgr_engine_cpu.so --worker dgr-worker \
               --upstream dgr_upstream.json --lock python-runtime.lock.json --wheel W.whl ... \
               --python-root tools tools/dgr/*.py ...

The archive holds, under `dgr-<lane>/`:
    lib/libdgr_engine.so     the ShardEngine (C ABI) of the lane
    bin/dgr-worker           the stage worker (C++, worker/server): serves a stage with no Python at all,
                             finding the engine in ../lib (`bin/dgr-worker serve --bundle B --stage N ...`)
    python/dgr/...           the dgr package: the operator's tooling, the engine binding
    python/<dep>/...         its Python dependencies: the locked wheels, unpacked (no pip, no network)
    bin/dgr                  the whole `dgr` command line on the host's python3 (generate, bundle provision,
                             --version, `dgr worker serve`, which runs bin/dgr-worker)
    upstream.json            llama.cpp's commit, tree hash and the patch series as applied
    release.json             dgr's version, the lane, the wheels' Python tag and the wheels
    MANIFEST.json            size and blake3 of every other file (also written beside the archive)

Same inputs, same bytes: entries sorted, mtime 0, owner root, modes 0644/0755, gzip without a name
or time. Called by the `release_<lane>` targets (toolchains/lanes.bzl). Standard library only, so any
python3 runs it (Bazel's actions get no PATH of the shell's, .bazelrc): the BLAKE3 of each file comes from
the dgr-worker it packs (`dgr-worker --blake3 FILE ...`: the official C implementation, pinned by
worker/third_party/blake3.json), not from a Python module.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import re
import sys
import tarfile
import zipfile

import subprocess
import tempfile

# Both launchers run the host's python3 on the release's own folders only: -S leaves the host's
# site-packages out, PYTHONPATH is the release's python/ (not the caller's), the engine is the release's.
LAUNCHER_SH = """#!/bin/sh
# {what} of this release: its own engine, Python package and Python dependencies (python/).
here=$(dirname "$(readlink -f "$0")")/..
py="${{PYTHON:-python3}}"
tag=$("$py" -S -c 'import sys; print("cp%d%d" % sys.version_info[:2])' 2>/dev/null) || {{
    echo "dgr: no $py on PATH: this release needs CPython {python_dots} (set PYTHON=/path/to/python3.x)" >&2; exit 2; }}
if [ "$tag" != "{python}" ]; then
    echo "dgr: $py is $tag, but this release carries Python dependencies built for {python} (CPython {python_dots}); set PYTHON to such a python3" >&2
    exit 2
fi
DGR_ENGINE_LIB="$here/lib/libdgr_engine.so" PYTHONPATH="$here/python" exec "$py" -S -m dgr "$@"
"""


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _version(init_py: bytes) -> str:
    m = re.search(rb'^__version__ = "([^"]+)"', init_py, re.M)
    if not m:
        raise SystemExit("release.py: no __version__ in dgr/__init__.py")
    return m.group(1).decode()


def _unpack_wheel(path: str, files: dict[str, tuple[bytes, int]]) -> None:
    """A wheel's importable files into python/ (what `pip install` would put in site-packages, minus
    scripts and headers: a worker needs neither), in name order."""
    with zipfile.ZipFile(path) as z:
        for info in sorted(z.infolist(), key=lambda i: i.filename):
            name = info.filename
            if name.endswith("/"):
                continue
            parts = name.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue
                name = "/".join(parts[2:])
            dest = "python/" + name
            if dest in files:
                raise SystemExit(f"release.py: {dest} comes from two wheels (the second: {path})")
            files[dest] = (z.read(info), 0o644)


def build(args: argparse.Namespace) -> tuple[bytes, bytes]:
    top = f"dgr-{args.lane}"
    files: dict[str, tuple[bytes, int]] = {}  # archive path -> (content, mode)
    files["lib/libdgr_engine.so"] = (_read(args.engine), 0o755)
    files["bin/dgr-worker"] = (_read(args.worker), 0o755)
    files["upstream.json"] = (_read(args.upstream), 0o644)
    root = args.python_root.rstrip("/") + "/"
    for src in args.python:
        if not src.startswith(root):
            raise SystemExit(f"release.py: {src} is not under --python-root {root}")
        files["python/" + src[len(root):]] = (_read(src), 0o644)
    lock = json.loads(_read(args.lock))
    locked = {e["file"]: e for e in lock["wheels"]}
    given = {os.path.basename(w): w for w in args.wheel}
    if set(given) != set(locked):
        raise SystemExit(f"release.py: the wheels given are not the lock's: missing {sorted(set(locked) - set(given))}, "
                         f"extra {sorted(set(given) - set(locked))}")
    for e in lock["wheels"]:
        _unpack_wheel(given[e["file"]], files)
    tag = lock["python"]
    dots = f"{tag[2]}.{tag[3:]}"
    text = LAUNCHER_SH.format(what="dgr", python=tag, python_dots=dots)
    files["bin/dgr"] = (text.encode(), 0o755)
    release = {
        "format": 1,
        "version": _version(files["python/dgr/__init__.py"][0]),
        "lane": args.lane,
        "python": tag,
        "wheels": [f"{e['name']}=={e['version']}" for e in lock["wheels"]],
    }
    files["release.json"] = ((json.dumps(release, indent=2, sort_keys=True) + "\n").encode(), 0o644)

    upstream = json.loads(files["upstream.json"][0])
    entries = sorted(files.items())
    digests = _blake3(getattr(args, "b3sum", None) or args.worker, [data for _, (data, _) in entries])
    manifest = {
        "format": 1,
        "lane": args.lane,
        "version": release["version"],
        "python": tag,
        "upstream": {k: upstream[k] for k in ("commit", "tree_hash", "patches")},
        "files": {path: {"size": len(data), "blake3": digest} for (path, (data, _)), digest in zip(entries, digests)},
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


def _blake3(worker: str, blobs: list[bytes]) -> list[str]:
    """The BLAKE3 (hex) of each blob, by `worker --blake3` over temporary files, in order."""
    with tempfile.TemporaryDirectory() as tmp:
        names = []
        for i, data in enumerate(blobs):
            names.append(os.path.join(tmp, str(i)))
            with open(names[-1], "wb") as f:
                f.write(data)
        argv = [worker]
        for n in names:
            argv += ["--blake3", n]
        out = subprocess.run(argv, capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"release.py: {worker} --blake3 failed ({out.returncode}): {out.stderr.strip()}")
        digests = {path: digest for digest, path in (line.split("  ", 1) for line in out.stdout.splitlines())}
        return [digests[n] for n in names]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="release.py")
    p.add_argument("--lane", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--manifest", required=True)
    p.add_argument("--engine", required=True)
    p.add_argument("--worker", required=True, help="dgr-worker (//worker/server:dgr-worker)")
    p.add_argument("--b3sum", help="what prints the files' BLAKE3 as `dgr-worker --blake3 FILE` does (default: --worker)")
    p.add_argument("--upstream", required=True)
    p.add_argument("--lock", required=True, help="toolchains/python-runtime.lock.json")
    p.add_argument("--wheel", action="extend", nargs="+", default=[], help="the locked wheels")
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
