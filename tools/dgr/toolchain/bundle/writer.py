"""The stage GGUF writer: header, tensor table, then tensor data, in that order only, hashed as written.

dgr writes the GGUF container itself (instead of `gguf.GGUFWriter`) so that the source's metadata
entries are copied bit for bit (`KV.raw`) and tensor data can be streamed in pieces.
"""

from __future__ import annotations

import struct
from enum import Enum, auto
from typing import Any, BinaryIO

import gguf

from dgr.core.errors import BundleError
from dgr.core.hashing import ChunkHasher
from dgr.gguf.model import GGUF_MAGIC, SCALAR_FORMATS, tensor_nbytes

_VT = gguf.GGUFValueType
GGUF_VERSION = 3


def _pack_str(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def pack_kv(key: str, vtype: gguf.GGUFValueType, value: Any) -> bytes:
    """One GGUF metadata entry (scalars and strings: what dgr writes)."""
    out = _pack_str(key) + struct.pack("<I", int(vtype))
    fmt = SCALAR_FORMATS.get(vtype)
    if fmt:
        return out + struct.pack(fmt, value)
    if vtype == _VT.STRING:
        return out + _pack_str(value)
    raise BundleError(f"dgr writes no {vtype.name} metadata (key {key})")


class _State(Enum):
    HEADER = auto()
    TENSOR_INFO = auto()
    DATA = auto()
    CLOSED = auto()


class StageWriter:
    """Writes one stage GGUF: header and metadata, tensor table, then tensor data, in that order only."""

    def __init__(self, f: BinaryIO, hasher: ChunkHasher, alignment: int):
        self.f, self.hasher, self.alignment = f, hasher, alignment
        self.state = _State.HEADER
        self.pos = 0
        self.tensors: list[tuple[str, tuple[int, ...], gguf.GGMLQuantizationType, int]] = []
        self.written = 0

    def _out(self, data: bytes | memoryview) -> None:
        self.f.write(data)
        self.hasher.update(data)
        self.pos += len(data)

    def _expect(self, state: _State, step: str) -> None:
        if self.state is not state:
            raise BundleError(f"stage writer: {step} expected state {state.name}, got {self.state.name}")

    def write_header(self, kv_entries: list[bytes], n_tensors: int) -> None:
        self._expect(_State.HEADER, "write_header")
        self._out(GGUF_MAGIC + struct.pack("<IQQ", GGUF_VERSION, n_tensors, len(kv_entries)))
        for e in kv_entries:
            self._out(e)
        self.n_tensors = n_tensors
        self.state = _State.TENSOR_INFO

    def write_tensor_infos(self, infos: list[tuple[str, tuple[int, ...], gguf.GGMLQuantizationType]]) -> None:
        self._expect(_State.TENSOR_INFO, "write_tensor_infos")
        if len(infos) != self.n_tensors:
            raise BundleError(f"stage writer: header said {self.n_tensors} tensors, got {len(infos)}")
        offset = 0
        buf = bytearray()
        for name, shape, qtype in infos:
            nbytes = tensor_nbytes(shape, qtype)
            buf += _pack_str(name) + struct.pack("<I", len(shape))
            for d in shape:
                buf += struct.pack("<Q", d)
            buf += struct.pack("<IQ", int(qtype), offset)
            self.tensors.append((name, shape, qtype, nbytes))
            offset += -(-nbytes // self.alignment) * self.alignment
        self._out(bytes(buf))
        self._pad()
        self.state = _State.DATA

    def _pad(self) -> None:
        pad = -self.pos % self.alignment
        if pad:
            self._out(b"\0" * pad)

    def write_tensor(self, pieces: Any) -> None:
        """Data of the next tensor in table order, as an iterable of byte pieces."""
        self._expect(_State.DATA, "write_tensor")
        if self.written >= len(self.tensors):
            raise BundleError("stage writer: more tensors written than declared")
        name, _, _, nbytes = self.tensors[self.written]
        n = 0
        for p in pieces:
            self._out(p)
            n += len(p)
        if n != nbytes:
            raise BundleError(f"stage writer: tensor {name!r} has {n} bytes, expected {nbytes}")
        self.written += 1
        self._pad()

    def close(self) -> None:
        self._expect(_State.DATA, "close")
        if self.written != len(self.tensors):
            raise BundleError(f"stage writer: {len(self.tensors) - self.written} declared tensors never written")
        self.state = _State.CLOSED
