"""What a GGUF file holds, read from its header alone: metadata, tensors, and which layer owns each tensor.

Other areas reuse this module (the engine and worker describe stages with it). It reads the header
with its own small parser instead of `gguf.GGUFReader` because the reader builds a numpy view per
vocabulary string (seconds on a 49k-token vocabulary) and because bundle building needs every
metadata entry's exact bytes so stage files keep the source's metadata bit for bit. Constants (value
and quantization types, block sizes) come from the `gguf` package.

Tensor ownership (`classify`): `blk.N.*` belongs to layer N; the token embedding belongs to the first
stage; `output_norm`, `output` and DeepSeek V4's hyper-connection head (`output_hc_*`) to the last;
rope frequency tables to every stage; anything else is unknown and reported.
"""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf

from dgr.core.constants import Keys as DgrKeys
from dgr.core.contract import DEFAULT_WIRE_DTYPE, StageContract, needs_token_ids
from dgr.core.errors import GGUFError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# Bounds on what a header may claim (llama.cpp's gguf reader has the same kind): a bogus count or
# length is refused before anything is allocated for it.
MAX_DIMS = 4            # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 4     # arrays of arrays: real models have none; bounds recursion on bad bytes
MAX_KEY_BYTES = 65536   # a metadata key or tensor name
MAX_LAYERS = 65536      # block_count (the largest models have a few hundred)
GK = gguf.Keys


class V4Keys:
    """DeepSeek V4 (`deepseek4`) keys the installed `gguf` package has no constant for (it predates V4);
    spelled as in the pinned llama.cpp's src/llama-arch.cpp. Format with `arch=`."""

    HYPER_CONNECTION_COUNT = "{arch}.hyper_connection.count"
    HYPER_CONNECTION_SINKHORN_ITERATIONS = "{arch}.hyper_connection.sinkhorn_iterations"
    HYPER_CONNECTION_EPSILON = "{arch}.hyper_connection.epsilon"
    HASH_LAYER_COUNT = "{arch}.hash_layer_count"
    COMPRESS_RATIOS = "{arch}.attention.compress_ratios"
    COMPRESS_ROPE_FREQ_BASE = "{arch}.attention.compress_rope_freq_base"
    OUTPUT_GROUP_COUNT = "{arch}.attention.output_group_count"
    OUTPUT_LORA_RANK = "{arch}.attention.output_lora_rank"


# struct formats of GGUF's scalar value types (read here, written by dgr.toolchain.bundle.writer)
SCALAR_FORMATS = {
    gguf.GGUFValueType.UINT8: "<B", gguf.GGUFValueType.INT8: "<b",
    gguf.GGUFValueType.UINT16: "<H", gguf.GGUFValueType.INT16: "<h",
    gguf.GGUFValueType.UINT32: "<I", gguf.GGUFValueType.INT32: "<i",
    gguf.GGUFValueType.FLOAT32: "<f", gguf.GGUFValueType.BOOL: "<?",
    gguf.GGUFValueType.UINT64: "<Q", gguf.GGUFValueType.INT64: "<q",
    gguf.GGUFValueType.FLOAT64: "<d",
}

# Roles of tensors that belong to no single layer.
INPUT = "input"    # first stage: token embedding
OUTPUT = "output"  # last stage: output norm, LM head (and the tied embedding)
SHARED = "shared"  # every stage: tables each layer reads (rope frequencies)

_INPUT_NAMES = ("token_embd", "token_embd_norm", "token_types", "position_embd",
                # gemma4 E2B/E4B per-layer embeddings (read from the first stage's token input)
                "per_layer_token_embd", "per_layer_model_proj", "per_layer_proj_norm")
_OUTPUT_NAMES = ("output_norm", "output", "output_hc_fn", "output_hc_base", "output_hc_scale",
                 "output_hc_norm", "output_hc_down", "output_hc_up", "cls", "cls.output")
_SHARED_NAMES = ("rope_freqs", "rope_factors_long", "rope_factors_short")
# names whose owner depends on the architecture: lfm2's final norm is called token_embd_norm
# (llama.cpp: LLM_TENSOR_OUTPUT_NORM_LFM2, an output tensor)
_OUTPUT_NAMES_OF = {"lfm2": ("token_embd_norm",), "lfm2moe": ("token_embd_norm",)}
_BLK = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True)
class KV:
    key: str
    type: gguf.GGUFValueType
    value: Any
    raw: bytes  # the whole entry (key, type, value) exactly as in the file
    sub_type: gguf.GGUFValueType | None = None


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order (ne0 first)
    type: gguf.GGMLQuantizationType
    offset: int             # relative to the data section
    nbytes: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class GGUFHeader:
    path: Path
    version: int
    kvs: dict[str, KV]
    tensors: list[TensorInfo]
    alignment: int
    data_offset: int  # absolute start of the data section

    def get(self, key: str, default: Any = None) -> Any:
        kv = self.kvs.get(key)
        return default if kv is None else kv.value

    def tensor(self, name: str) -> TensorInfo:
        for t in self.tensors:
            if t.name == name:
                return t
        raise GGUFError(f"{self.path}: no tensor named {name!r}")


def tensor_nbytes(shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = 1
    for d in shape:
        n *= d
    if n % block:
        raise GGUFError(f"tensor of shape {shape} is not a whole number of {qtype.name} blocks ({block})")
    return n // block * size


class _Buf:
    """Parses the header straight from a read-only memory map of the file (no copies, no reads ahead)."""

    def __init__(self, mm: "mmap.mmap", path: Path):
        self.buf, self.path = mm, path
        self.size = len(mm)
        self.pos = 0

    def need(self, n: int) -> None:
        if self.pos + n > self.size:
            raise GGUFError(f"{self.path}: truncated GGUF header (needed {n} bytes at offset {self.pos})")

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def string(self, limit: int | None = None) -> str:
        n = self.unpack("<Q")
        if limit is not None and n > limit:
            raise GGUFError(f"{self.path}: a name of {n} bytes at offset {self.pos - 8} (at most {limit}): "
                            "the header is corrupt")
        self.need(n)
        s = self.buf[self.pos:self.pos + n]
        self.pos += n
        return s.decode("utf-8", errors="surrogateescape")

    def strings(self, count: int) -> list[str]:
        # the vocabulary: tens of thousands of strings, so one tight loop
        buf, pos, size, out = self.buf, self.pos, self.size, []
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if pos + 8 > size:
                break
            (n,) = unpack(buf, pos)
            pos += 8
            if pos + n > size:
                break
            out.append(buf[pos:pos + n].decode("utf-8", errors="surrogateescape"))
            pos += n
        self.pos = pos
        if len(out) != count:
            self.need(self.size + 1)
        return out

    def vtype(self) -> gguf.GGUFValueType:
        code = self.unpack("<I")
        try:
            return gguf.GGUFValueType(code)
        except ValueError:
            raise GGUFError(f"{self.path}: unknown GGUF value type {code} at offset {self.pos - 4}: "
                            "the header is corrupt or from a newer GGUF version") from None

    def value(self, vtype: gguf.GGUFValueType, depth: int = 0) -> tuple[Any, gguf.GGUFValueType | None]:
        if vtype in SCALAR_FORMATS:
            return self.unpack(SCALAR_FORMATS[vtype]), None
        if vtype == gguf.GGUFValueType.STRING:
            return self.string(), None
        if vtype == gguf.GGUFValueType.ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise GGUFError(f"{self.path}: arrays nested over {MAX_ARRAY_DEPTH} deep at offset {self.pos}: "
                                "the header is corrupt")
            sub = self.vtype()
            n = self.unpack("<Q")
            if n > self.size - self.pos:  # every element takes at least one byte
                raise GGUFError(f"{self.path}: an array of {n} elements at offset {self.pos - 8} cannot fit "
                                f"in a {self.size}-byte file: the header is corrupt or truncated")
            if sub in SCALAR_FORMATS:
                fmt = SCALAR_FORMATS[sub]
                size = struct.calcsize(fmt)
                self.need(size * n)
                vals = list(struct.unpack_from("<" + fmt[1] * n, self.buf, self.pos))
                self.pos += size * n
                return vals, sub
            if sub == gguf.GGUFValueType.STRING:
                return self.strings(n), sub
            return [self.value(sub, depth + 1)[0] for _ in range(n)], sub
        raise GGUFError(f"{self.path}: unknown GGUF value type {vtype} at offset {self.pos}")


def read_header(path: str | Path) -> GGUFHeader:
    """Parse a GGUF file's header (metadata and tensor table) without reading tensor data."""
    path = Path(path)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise GGUFError(f"{path}: cannot open ({e.strerror})") from e
    with f:
        try:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:
            raise GGUFError(f"{path}: empty file, not a GGUF model") from None
        try:
            return _parse(mm, path)
        except GGUFError:
            raise
        except (ValueError, KeyError, IndexError, TypeError, OverflowError, struct.error, RecursionError,
                MemoryError) as e:  # a safety net: bad bytes end in GGUFError, whatever they broke
            raise GGUFError(f"{path}: corrupt GGUF header ({type(e).__name__}: {e})") from None
        finally:
            mm.close()


def _parse(mm: "mmap.mmap", path: Path) -> GGUFHeader:
    b = _Buf(mm, path)
    b.need(4)
    if b.buf[:4] != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (magic {b.buf[:4]!r}, expected b'GGUF')")
    b.pos = 4
    version = b.unpack("<I")
    if version not in (2, 3):
        raise GGUFError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    n_tensors = b.unpack("<Q")
    n_kv = b.unpack("<Q")
    # each entry takes at least 12 bytes (a length and a type), each tensor at least 24
    if n_kv * 12 + n_tensors * 24 > b.size - b.pos:
        raise GGUFError(f"{path}: the header claims {n_kv} metadata entries and {n_tensors} tensors, more "
                        f"than a {b.size}-byte file can hold: the header is corrupt or truncated")
    kvs: dict[str, KV] = {}
    for _ in range(n_kv):
        start = b.pos
        key = b.string(MAX_KEY_BYTES)
        vtype = b.vtype()
        val, sub = b.value(vtype)
        if key in kvs:
            raise GGUFError(f"{path}: duplicate metadata key {key!r}")
        kvs[key] = KV(key, vtype, val, bytes(b.buf[start:b.pos]), sub)
    tensors: list[TensorInfo] = []
    seen: set[str] = set()
    for _ in range(n_tensors):
        name = b.string(MAX_KEY_BYTES)
        n_dims = b.unpack("<I")
        if n_dims > MAX_DIMS:
            raise GGUFError(f"{path}: tensor {name!r} has {n_dims} dimensions (at most {MAX_DIMS}): "
                            "the header is corrupt")
        shape = tuple(b.unpack("<Q") for _ in range(n_dims))
        code = b.unpack("<I")
        try:
            qtype = gguf.GGMLQuantizationType(code)
            gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise GGUFError(f"{path}: tensor {name!r} has unknown type {code}: the header is corrupt or the "
                            "model uses a type this gguf package does not know") from None
        offset = b.unpack("<Q")
        if name in seen:
            raise GGUFError(f"{path}: duplicate tensor {name!r}")
        seen.add(name)
        try:
            nbytes = tensor_nbytes(shape, qtype)
        except GGUFError as e:
            raise GGUFError(f"{path}: tensor {name!r}: {e}") from None
        tensors.append(TensorInfo(name, shape, qtype, offset, nbytes))
    alignment = kvs[GK.General.ALIGNMENT].value if GK.General.ALIGNMENT in kvs else DEFAULT_ALIGNMENT
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
        raise GGUFError(f"{path}: {GK.General.ALIGNMENT} is {alignment!r}; it must be a power of two")
    data_offset = -(-b.pos // alignment) * alignment
    size = b.size
    for t in tensors:
        if data_offset + t.offset + t.nbytes > size:
            raise GGUFError(f"{path}: tensor {t.name!r} extends past the end of the file "
                            f"({data_offset + t.offset + t.nbytes} > {size} bytes): the file is truncated")
    return GGUFHeader(path, version, kvs, tensors, alignment, data_offset)


def classify(name: str, arch: str | None = None) -> int | str | None:
    """Layer index for `blk.N.*`, INPUT / OUTPUT / SHARED for global tensors, None when unknown."""
    m = _BLK.match(name)
    if m:
        return int(m.group(1))
    base = name.rsplit(".", 1)[0] if name.endswith((".weight", ".bias")) else name
    if base in _OUTPUT_NAMES_OF.get(arch or "", ()):
        return OUTPUT
    if base in _INPUT_NAMES:
        return INPUT
    if base in _OUTPUT_NAMES:
        return OUTPUT
    if base in _SHARED_NAMES:
        return SHARED
    return None


@dataclass
class ModelInfo:
    """A model's shape as dgr sees it: layers, widths, the boundary a split carries, tensor owners."""

    path: Path
    arch: str
    n_layer: int          # main layers (placement covers [0, n_layer))
    n_layer_all: int      # block_count, including MTP / next-n layers
    n_embd: int
    n_streams: int        # residual streams crossing a seam (DeepSeek V4 mHC: hc_mult)
    n_hash_layers: int    # leading layers that route by token id (need the token-id sideband)
    tied_embeddings: bool
    header: GGUFHeader
    layer_of: dict[str, int | str] = field(default_factory=dict)
    unknown: list[str] = field(default_factory=list)

    @property
    def mtp_layers(self) -> range:
        return range(self.n_layer, self.n_layer_all)

    def layer_bytes(self) -> list[int]:
        out = [0] * self.n_layer_all
        for t in self.header.tensors:
            owner = self.layer_of.get(t.name)
            if isinstance(owner, int) and owner < self.n_layer_all:
                out[owner] += t.nbytes
        return out

    def role_bytes(self, role: str) -> int:
        return sum(t.nbytes for t in self.header.tensors if self.layer_of.get(t.name) == role)

    def needs_token_ids(self, begin: int) -> bool:
        """Whether a stage whose range starts at layer `begin` needs token ids beside the residual."""
        return needs_token_ids(begin, self.n_hash_layers)

    def stage_contract(self, begin: int, end: int, *, dtype: str = DEFAULT_WIRE_DTYPE) -> StageContract:
        """The contract of a stage of this model owning layers [begin, end), carried in `dtype`."""
        return StageContract.plan(begin, end, self.n_layer, n_streams=self.n_streams, n_embd=self.n_embd,
                                  n_hash_layers=self.n_hash_layers, dtype=dtype)


def _arch_int(h: GGUFHeader, arch: str, template: str, default: int | None = None, limit: int = 2**32) -> int:
    key = template.format(arch=arch)
    v = h.get(key, default)
    if v is None:
        raise GGUFError(f"{h.path}: metadata key {key} is missing; is this a complete model file?")
    if isinstance(v, list):
        v = v[0] if v else None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or not 0 <= v < limit:
        raise GGUFError(f"{h.path}: metadata key {key} is {v!r}, not a count (0 to {limit - 1}); the file is corrupt")
    return int(v)


def model_info(path_or_header: str | Path | GGUFHeader) -> ModelInfo:
    h = path_or_header if isinstance(path_or_header, GGUFHeader) else read_header(path_or_header)
    arch = h.get(GK.General.ARCHITECTURE)
    if not isinstance(arch, str):
        raise GGUFError(f"{h.path}: {GK.General.ARCHITECTURE} is missing; not a llama.cpp model file")
    n_all = _arch_int(h, arch, GK.LLM.BLOCK_COUNT, limit=MAX_LAYERS)
    n_nextn = _arch_int(h, arch, GK.LLM.NEXTN_PREDICT_LAYERS, 0)
    if n_nextn > n_all:
        raise GGUFError(f"{h.path}: {n_nextn} next-n layers but only {n_all} blocks: the file is corrupt")
    n_embd = _arch_int(h, arch, GK.LLM.EMBEDDING_LENGTH)
    n_streams = _arch_int(h, arch, V4Keys.HYPER_CONNECTION_COUNT, 1) if arch == "deepseek4" else 1
    n_hash = _arch_int(h, arch, V4Keys.HASH_LAYER_COUNT, 0)
    layer_of: dict[str, int | str] = {}
    unknown: list[str] = []
    for t in h.tensors:
        owner = classify(t.name, arch)
        if owner is None or (isinstance(owner, int) and owner >= n_all):
            unknown.append(t.name)
        else:
            layer_of[t.name] = owner
    names = {t.name for t in h.tensors}
    tied = "output.weight" not in names
    idx, cnt = h.get(DgrKeys.STAGE_INDEX), h.get(DgrKeys.STAGE_COUNT)
    if isinstance(idx, int) and isinstance(cnt, int):  # a bundle stage: only the last one shows the LM head
        tied = tied and idx == cnt - 1 and "token_embd.weight" in names
    return ModelInfo(
        path=h.path, arch=arch, n_layer=n_all - n_nextn, n_layer_all=n_all, n_embd=n_embd,
        n_streams=n_streams, n_hash_layers=n_hash, tied_embeddings=tied,
        header=h, layer_of=layer_of, unknown=unknown,
    )
