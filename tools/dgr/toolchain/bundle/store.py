"""Stores: `provision` (a verified, resumable copy of a bundle into a store), `refuse_home`, full-disk errors.

`refuse_home` is the rule that stores live on a mounted data drive, never under /home.

A bundle is copied into a hidden working folder (`.provision-NAME-ID12`), each stage to `FILE.part`
renamed when whole; an interrupted copy keeps its verified prefix there. The manifest is written last
and the folder renamed to `NAME-ID12` after it, so a store folder of that name is always a whole bundle.
A full disk ends in a StoreError saying what was being written, how much was needed and what to do.
"""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from dgr.core.constants import MANIFEST_NAME
from dgr.core.errors import BundleError, StoreError
from dgr.core.hashing import bytes_blake3
from dgr.toolchain.bundle.manifest import load_bundle, manifest_bytes

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


def no_space(err: OSError) -> bool:
    return err.errno in (errno.ENOSPC, errno.EDQUOT)


def free_bytes(path: Path) -> int:
    """Bytes free to a writer at `path` (its nearest existing parent)."""
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def disk_full(store: Path, what: str, needed: int, kept: str, *, at_least: bool = False) -> StoreError:
    """The full-disk error: what is full, how much was needed, what to do."""
    return StoreError(f"{store}: no space left on the device while {what}: the bundle needs "
                      f"{'at least ' if at_least else ''}{needed} bytes "
                      f"({needed / 2**20:.1f} MiB) and {free_bytes(store)} bytes are free; free some space or "
                      f"choose a store on a larger drive. {kept}")


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

    The copy is made in `to/.provision-NAME-ID12/` (a stage to `FILE.part`, renamed when whole; an
    interrupted copy keeps its verified prefix) and renamed to `to/NAME-ID12/` after the manifest is
    written, so a folder of that name is always a whole bundle. A provisioned bundle provisioned again is
    moved back into the working folder and re-checked. A full disk raises StoreError.
    """
    to = refuse_home(Path(to), "store")
    b = load_bundle(path)
    m = b.manifest
    chunk = m.chunk_size
    name = f"{m.recipe.name}-{b.id[:12]}"
    dest, work = to / name, to / f".provision-{name}"
    if dest.exists() and dest.resolve() == b.root.resolve():
        raise StoreError(f"{dest} is the bundle itself; provision copies into another store "
                         f"(use `dgr bundle verify {b.root}` to check it in place)")
    rep = ProvisionReport(dest=dest, bundle_id=b.id, chunks_total=sum(len(s.chunks) for s in m.stages))
    total = sum(s.size for s in m.stages)
    kept = (f"The verified part of the copy is kept in {work} (not a bundle): rerun the same command to "
            f"resume, or delete that folder to reclaim its space.")
    try:
        to.mkdir(parents=True, exist_ok=True)
        if dest.exists() and not work.exists():
            os.replace(dest, work)      # re-check an earlier copy (or resume one of an older dgr) out of sight
        work.mkdir(exist_ok=True)
        (work / MANIFEST_NAME).unlink(missing_ok=True)
        present = sum(min(f.stat().st_size, s.size) for s in m.stages
                      for f in (work / s.file, work / (s.file + ".part")) if f.is_file())
        if total - present > free_bytes(work):
            raise disk_full(to, "checking for room before copying", total, kept)
        for s in m.stages:
            if not _copy_stage(b.root, work, s, chunk, rep, max_chunks, dest):
                return rep
        mtmp = work / (MANIFEST_NAME + ".part")
        mtmp.write_bytes(manifest_bytes(m))
        os.replace(mtmp, work / MANIFEST_NAME)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(work, dest)          # the last step: the bundle appears whole
    except OSError as e:
        if no_space(e):
            (work / (MANIFEST_NAME + ".part")).unlink(missing_ok=True)
            raise disk_full(to, f"writing {e.filename or work}", total, kept) from None
        raise
    rep.complete = True
    return rep


def _copy_stage(root: Path, work: Path, s, chunk: int, rep: ProvisionReport, max_chunks: int | None,
                dest: Path) -> bool:
    """Copy (or finish, or re-check) one stage file into `work`; False when `max_chunks` ran out."""
    final, part = work / s.file, work / (s.file + ".part")
    if final.exists() and final.stat().st_size == s.size:
        os.replace(final, part)  # re-check it below like a partial copy
    have = _verified_prefix(part, s.chunks, chunk, s.size) if part.exists() else 0
    rep.chunks_reused += have
    src_path = root / s.file
    if not src_path.is_file():
        raise BundleError(f"{src_path}: stage {s.index} file is missing from the source bundle")
    with open(src_path, "rb") as src, open(part, "ab") as out:
        src.seek(have * chunk)
        for k in range(have, len(s.chunks)):
            if max_chunks is not None and rep.chunks_copied >= max_chunks:
                return False
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
    return True
