"""File hashing, once for all of dgr: blake3 (bundles, sources, the upstream tree) and sha256 (archives).

Stdlib + blake3 only, so that the scripts Bazel and Nix run outside an installed dgr
(`toolchains/bazel/blake3sum.py`, `tools/dgr/toolchain/treehash.py`) can import it by path.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import blake3

# Files are read in fixed pieces into one reused buffer: memory stays bounded for any size
# (`blake3.update_mmap` would map the whole file and show it all as resident memory).
READ_SIZE = 4 * 1024 * 1024


def _feed(path: str | Path, h) -> None:
    buf = bytearray(READ_SIZE)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])


def file_blake3(path: str | Path, *, threads: bool = True) -> str:
    """Hex blake3 of a file's bytes (multi-threaded for large files unless `threads` is False)."""
    h = blake3.blake3(max_threads=blake3.blake3.AUTO) if threads else blake3.blake3()
    _feed(path, h)
    return h.hexdigest()


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes (upstream archives are pinned by sha256)."""
    h = hashlib.sha256()
    _feed(path, h)
    return h.hexdigest()


def bytes_blake3(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


class ChunkHasher:
    """blake3 of a whole stream and of each fixed-size chunk of it, fed as the bytes go by (bundle
    files are hashed while they are written, and verified chunk by chunk, resumably)."""

    def __init__(self, chunk_size: int):
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.chunk_size = chunk_size
        self.whole = blake3.blake3()
        self.chunk = blake3.blake3()
        self.fill = 0
        self.chunks: list[str] = []
        self.size = 0

    def update(self, data: bytes | memoryview) -> None:
        mv = memoryview(data)
        self.whole.update(mv)
        self.size += len(mv)
        while len(mv):
            take = min(len(mv), self.chunk_size - self.fill)
            self.chunk.update(mv[:take])
            self.fill += take
            mv = mv[take:]
            if self.fill == self.chunk_size:
                self.chunks.append(self.chunk.hexdigest())
                self.chunk = blake3.blake3()
                self.fill = 0

    def finish(self) -> tuple[str, list[str]]:
        """(blake3 of everything, blake3 of each chunk); the last chunk may be short."""
        if self.fill:
            self.chunks.append(self.chunk.hexdigest())
            self.chunk = blake3.blake3()
            self.fill = 0
        return self.whole.hexdigest(), self.chunks


def series_hash(patches: list[tuple[str, str]]) -> str:
    """The hash over the ordered patch stack (blake3 of `file NUL blake3 LF` per patch): with the commit,
    it names the engine a worker runs. Here (stdlib + blake3) so that the Bazel repository rule computes the
    same one (toolchains/bazel/blake3sum.py --series) before anything is built."""
    return bytes_blake3("".join(f"{f}\0{b}\n" for f, b in patches).encode())
