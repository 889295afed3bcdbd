"""Stores: `provision` (a verified, resumable copy of a bundle into a store) and `refuse_home`.

`refuse_home` is the rule that stores live on a mounted data drive, never under /home.

A stage is copied to `FILE.part` and renamed when whole; an interrupted copy keeps its verified
prefix. The manifest is written last, so a store folder with a manifest is a complete bundle.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from dgr.bundle.manifest import load_bundle, manifest_bytes
from dgr.constants import MANIFEST_NAME
from dgr.errors import BundleError, StoreError
from dgr.hashing import bytes_blake3

_HOME = Path("/home")


def refuse_home(path: Path, what: str) -> Path:
    """`path` made absolute; StoreError when it (or what it resolves to) is under /home."""
    p = Path(os.path.abspath(Path(path).expanduser()))
    try:
        real = p.resolve()
    except OSError:
        real = p
    for cand in (p, real):
        if cand == _HOME or _HOME in cand.parents:
            raise StoreError(f"{what} {path} is under /home: stores belong on a mounted data drive, not in home "
                             f"directories; choose a path outside /home (e.g. /mnt/models or /srv/dgr)")
    return p


@dataclass
class ProvisionReport:
    dest: Path
    bundle_id: str
    chunks_total: int
    chunks_copied: int = 0
    chunks_reused: int = 0   # already in the store from an earlier (interrupted) run, re-hashed
    complete: bool = False


def _verified_prefix(part: Path, chunks: list[str], chunk: int, size: int) -> int:
    """How many leading chunks of `part` match the manifest; the rest is cut off."""
    have = 0
    with open(part, "rb") as f:
        while have < len(chunks):
            data = f.read(chunk)
            if not data or bytes_blake3(data) != chunks[have]:
                break
            have += 1
    with open(part, "r+b") as f:
        f.truncate(min(have * chunk, size))
    return have


def provision(path: str | Path, to: str | Path, *, max_chunks: int | None = None,
              progress: bool = False) -> ProvisionReport:
    """Copy a bundle into the store `to`, verifying each chunk as it is copied; resumable.

    A stage is copied to `FILE.part` and renamed when whole; an interrupted copy keeps its verified
    prefix. The manifest is written last, so a store folder with a manifest is a complete bundle.
    """
    to = refuse_home(Path(to), "store")
    b = load_bundle(path)
    m = b.manifest
    chunk = m.chunk_size
    dest = to / f"{m.recipe.name}-{b.id[:12]}"
    if dest.exists() and dest.resolve() == b.root.resolve():
        raise StoreError(f"{dest} is the bundle itself; provision copies into another store "
                         f"(use `dgr bundle verify {b.root}` to check it in place)")
    dest.mkdir(parents=True, exist_ok=True)
    rep = ProvisionReport(dest=dest, bundle_id=b.id, chunks_total=sum(len(s.chunks) for s in m.stages))
    for s in m.stages:
        final, part = dest / s.file, dest / (s.file + ".part")
        if final.exists() and final.stat().st_size == s.size:
            os.replace(final, part)  # re-check it below like a partial copy
        have = _verified_prefix(part, s.chunks, chunk, s.size) if part.exists() else 0
        rep.chunks_reused += have
        src_path = b.root / s.file
        if not src_path.is_file():
            raise BundleError(f"{src_path}: stage {s.index} file is missing from the source bundle")
        with open(src_path, "rb") as src, open(part, "ab") as out:
            src.seek(have * chunk)
            for k in range(have, len(s.chunks)):
                if max_chunks is not None and rep.chunks_copied >= max_chunks:
                    return rep
                data = src.read(chunk)
                if bytes_blake3(data) != s.chunks[k]:
                    raise BundleError(f"{src_path}: chunk {k} (bytes {k * chunk}-) does not match the manifest: "
                                      f"the source bundle is corrupt; nothing corrupt was copied to {dest}")
                out.write(data)
                out.flush()
                rep.chunks_copied += 1
            os.fsync(out.fileno())
        if part.stat().st_size != s.size:
            raise BundleError(f"{part}: copied {part.stat().st_size} bytes, expected {s.size}")
        os.replace(part, final)
    mtmp = dest / (MANIFEST_NAME + ".part")
    mtmp.write_bytes(manifest_bytes(m))
    os.replace(mtmp, dest / MANIFEST_NAME)
    rep.complete = True
    return rep
