"""Bundles: a recipe built into one GGUF per stage plus a canonical, hashed manifest.

Building is streaming (tensor data is copied in pieces; only a tensor being re-quantized is held in
memory) and deterministic (no timestamps, no absolute paths; the same recipe and source give the same
bytes). The steps run in order and refuse to run out of order; sealing the manifest comes last:

    plan -> write stage files (hashing as they are written) -> seal manifest -> move into the store

The bundle id is the blake3 of the canonical manifest (`manifest.json` is stored in canonical form,
so the id is also the blake3 of that file).

`load_bundle(path)` is the library entry point for workers: the validated manifest, the bundle id
and each stage's file path.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import struct
from dataclasses import dataclass, field
from enum import Enum, auto
from pathlib import Path
from typing import Any, BinaryIO, Callable

import blake3
import gguf
import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from dgr.constants import FORMAT_VERSION, MANIFEST_NAME, Keys
from dgr.errors import BundleError, RecipeError, StoreError
from dgr.ggufmodel import INPUT, OUTPUT, SHARED, GGUFHeader, ModelInfo, TensorInfo, model_info, tensor_nbytes
from dgr.paths import workspace
from dgr.planner import WorkerSpec, plan
from dgr.recipe import KEEP, LoadedRecipe, check_ranges, load_recipe
from dgr.source import resolve

_STRICT = ConfigDict(extra="forbid", strict=True, frozen=True)
_COPY = 4 * 1024 * 1024
_VT = gguf.GGUFValueType


# ---------------------------------------------------------------- manifest model

class BoundarySchema(BaseModel):
    """What crosses the seam into a stage: the residual [n_tokens, n_streams, n_embd] in `dtype`."""

    model_config = _STRICT
    n_streams: int
    n_embd: int
    dtype: str
    token_ids: bool  # the token-id sideband travels with the residual


class StageEntry(BaseModel):
    model_config = _STRICT
    index: int
    file: str
    size: int
    blake3: str
    chunks: list[str]
    layer_begin: int
    layer_end: int
    tensor_count: int
    weight_bytes: int
    boundary_in: BoundarySchema | None   # None on the first stage: it takes token ids
    boundary_out: BoundarySchema | None  # None on the last stage: it produces logits


class ManifestRecipe(BaseModel):
    model_config = _STRICT
    name: str
    blake3: str
    text: str


class ManifestSource(BaseModel):
    model_config = _STRICT
    uri: str
    blake3: str
    size: int
    provenance: dict[str, str] | None


class ManifestModel(BaseModel):
    model_config = _STRICT
    arch: str
    n_layer: int
    n_layer_all: int
    n_embd: int
    n_streams: int
    n_hash_layers: int
    tied_embeddings: bool


class Manifest(BaseModel):
    model_config = _STRICT
    format_version: int
    recipe: ManifestRecipe
    source: ManifestSource
    model: ManifestModel
    boundary_dtype: str
    lanes: list[str]
    chunk_size: int
    stages: list[StageEntry]
    excluded_tensors: list[str]  # MTP layers, left out by design (reserved for beta)


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def manifest_bytes(m: Manifest) -> bytes:
    return canonical_json(m.model_dump(mode="json"))


@dataclass(frozen=True)
class Bundle:
    """A loaded bundle: its manifest, its id and where its stage files are."""

    root: Path
    manifest: Manifest
    id: str

    @property
    def stage_paths(self) -> list[Path]:
        return [self.root / s.file for s in self.manifest.stages]

    def stage_path(self, index: int) -> Path:
        return self.root / self.manifest.stages[index].file


def load_bundle(path: str | Path) -> Bundle:
    """Read and validate `path/manifest.json` (or a manifest path). Does not hash the stage files."""
    path = Path(path)
    mpath = path if path.is_file() else path / MANIFEST_NAME
    try:
        raw = mpath.read_bytes()
    except OSError as e:
        raise BundleError(f"{mpath}: cannot read the bundle manifest ({e.strerror}); is {path} a bundle folder?") from e
    try:
        m = Manifest.model_validate_json(raw)
    except ValidationError as e:
        first = e.errors()[0]
        raise BundleError(f"{mpath}: not a valid dgr manifest: {'.'.join(map(str, first['loc']))}: {first['msg']}") from e
    if m.format_version != FORMAT_VERSION:
        raise BundleError(f"{mpath}: format_version {m.format_version}, this dgr reads {FORMAT_VERSION}; use a matching dgr")
    if manifest_bytes(m) != raw:
        raise BundleError(f"{mpath}: the manifest is not in canonical form (was it edited?); rebuild or re-provision the bundle")
    for s in m.stages:
        if Path(s.file).name != s.file or s.file in ("", ".", ".."):
            raise BundleError(f"{mpath}: stage {s.index} file {s.file!r} is not a plain file name")
    return Bundle(root=mpath.parent, manifest=m, id=blake3.blake3(raw).hexdigest())


# ---------------------------------------------------------------- stage file writing

class _ChunkHasher:
    """blake3 of a whole stream and of each fixed-size chunk, fed as bytes are written."""

    def __init__(self, chunk_size: int):
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
        if self.fill:
            self.chunks.append(self.chunk.hexdigest())
        return self.whole.hexdigest(), self.chunks


def _pack_str(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def pack_kv(key: str, vtype: gguf.GGUFValueType, value: Any) -> bytes:
    """One GGUF metadata entry (scalars and strings: what dgr writes)."""
    out = _pack_str(key) + struct.pack("<I", int(vtype))
    fmt = {_VT.UINT32: "<I", _VT.INT32: "<i", _VT.UINT64: "<Q", _VT.BOOL: "<?", _VT.FLOAT32: "<f"}.get(vtype)
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

    def __init__(self, f: BinaryIO, hasher: _ChunkHasher, alignment: int):
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
        self._out(b"GGUF" + struct.pack("<IQQ", 3, n_tensors, len(kv_entries)))
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


# ---------------------------------------------------------------- quantization

def target_type(name: str, src: gguf.GGMLQuantizationType, recipe: LoadedRecipe) -> gguf.GGMLQuantizationType:
    q = recipe.recipe.quantization
    chosen = q.default
    for rule in q.rules:
        if fnmatch.fnmatchcase(name, rule.pattern):
            chosen = rule.type
            break
    return src if chosen == KEEP else gguf.GGMLQuantizationType[chosen]


_NUMPY_TYPES = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}


def can_quantize(qtype: gguf.GGMLQuantizationType) -> bool:
    if qtype in _NUMPY_TYPES:
        return True
    traits = gguf.quants._type_traits.get(qtype)
    if traits is None:
        return False
    try:
        traits.quantize_blocks(np.zeros((1, traits.block_size), dtype=np.float32))
    except NotImplementedError:
        return False
    return True


def check_conversion(t: TensorInfo, dst: gguf.GGMLQuantizationType, recipe_path: Path) -> None:
    if dst == t.type:
        return
    if not can_quantize(dst):
        raise RecipeError(f"{recipe_path}: quantization: tensor {t.name!r} -> {dst.name} needs the pinned "
                          f"llama.cpp quantizer (llama-quantize); the gguf package cannot produce {dst.name}. "
                          f"Use one of F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, or keep")
    block = gguf.GGML_QUANT_SIZES[dst][0]
    if t.shape[0] % block:
        raise RecipeError(f"{recipe_path}: quantization: tensor {t.name!r} rows have {t.shape[0]} values, not a "
                          f"multiple of {dst.name}'s block of {block}; exclude it from that rule")
    if t.type not in _NUMPY_TYPES and t.type not in gguf.quants._type_traits:
        raise RecipeError(f"{recipe_path}: quantization: tensor {t.name!r} is {t.type.name}, which dgr cannot "
                          f"dequantize; keep its type")


def _convert(raw: np.ndarray, t: TensorInfo, dst: gguf.GGMLQuantizationType) -> bytes:
    rows = raw.reshape(-1, tensor_nbytes((t.shape[0],), t.type))
    if t.type in _NUMPY_TYPES:
        floats = rows.view(_NUMPY_TYPES[t.type]).astype(np.float32)
    else:
        floats = gguf.quants.dequantize(rows, t.type).astype(np.float32)
    if dst in _NUMPY_TYPES:
        return floats.astype(_NUMPY_TYPES[dst]).tobytes()
    return gguf.quants.quantize(floats, dst).tobytes()


# ---------------------------------------------------------------- planning

@dataclass
class StagePlan:
    index: int
    begin: int
    end: int
    tensors: list[tuple[TensorInfo, gguf.GGMLQuantizationType]] = field(default_factory=list)

    @property
    def weight_bytes(self) -> int:
        return sum(tensor_nbytes(t.shape, q) for t, q in self.tensors)


@dataclass
class BuildPlan:
    recipe: LoadedRecipe
    source_path: Path
    source_blake3: str
    info: ModelInfo
    stages: list[StagePlan]
    excluded: list[str]


def _owner_ok(owner: int | str, sp: StagePlan, n_stages: int, tied: bool, name: str) -> bool:
    if isinstance(owner, int):
        return sp.begin <= owner < sp.end
    if owner == SHARED:
        return True
    if owner == INPUT:
        return sp.index == 0 or (tied and name == "token_embd.weight" and sp.index == n_stages - 1)
    if owner == OUTPUT:
        return sp.index == n_stages - 1
    return False


def make_plan(recipe: LoadedRecipe, *, progress: bool = False) -> BuildPlan:
    r = recipe.recipe
    src = resolve(r.source.uri, r.source.blake3, base_dir=recipe.path.parent, progress=progress)
    info = model_info(src)
    n_split = info.header.get("split.count", 1)
    if n_split and int(n_split) > 1:
        raise BundleError(f"{src}: is part 1 of a {n_split}-file split GGUF; dgr reads single-file models: "
                          f"merge it first (llama-gguf-split --merge) and point source.uri at the merged file")
    if info.unknown:
        raise BundleError(f"{src}: tensors that belong to no layer dgr understands: {info.unknown[:10]}"
                          f"{' ...' if len(info.unknown) > 10 else ''}; dgr cannot place them in a stage "
                          f"(teach dgr.ggufmodel.classify about them)")
    targets: dict[str, gguf.GGMLQuantizationType] = {}
    for t in info.header.tensors:
        dst = target_type(t.name, t.type, recipe)
        check_conversion(t, dst, recipe.path)
        targets[t.name] = dst
    layer_bytes = [0] * info.n_layer
    role = {INPUT: 0, OUTPUT: 0, SHARED: 0}
    excluded: list[str] = []
    for t in info.header.tensors:
        owner = info.layer_of[t.name]
        nb = tensor_nbytes(t.shape, targets[t.name])
        if isinstance(owner, int):
            if owner >= info.n_layer:
                excluded.append(t.name)  # MTP: reserved, off for alpha
            else:
                layer_bytes[owner] += nb
        else:
            role[owner] += nb
            if owner == INPUT and info.tied_embeddings and t.name == "token_embd.weight":
                role[OUTPUT] += nb
    if r.placement.stages is not None:
        ranges = list(r.placement.stages)
        try:
            check_ranges(ranges, info.n_layer)
        except ValueError as e:
            raise RecipeError(f"{recipe.path}: placement.stages: {e} (model {info.arch}, {info.n_layer} layers)") from None
    else:
        workers = [WorkerSpec(w.name, w.memory, w.speed) for w in r.placement.workers or []]
        try:
            ranges = list(plan(layer_bytes, workers, input_bytes=role[INPUT], output_bytes=role[OUTPUT],
                               shared_bytes=role[SHARED]).ranges)
        except RecipeError as e:
            raise RecipeError(f"{recipe.path}: {e}") from None
    stages = [StagePlan(i, b, e) for i, (b, e) in enumerate(ranges)]
    for t in info.header.tensors:
        if t.name in excluded:
            continue
        owner = info.layer_of[t.name]
        homes = [sp for sp in stages if _owner_ok(owner, sp, len(stages), info.tied_embeddings, t.name)]
        if not homes:
            raise BundleError(f"{src}: tensor {t.name!r} (owner {owner}) lands in no stage of {ranges}")
        for sp in homes:
            sp.tensors.append((t, targets[t.name]))
    return BuildPlan(recipe, src, r.source.blake3, info, stages, excluded)


# ---------------------------------------------------------------- build

def refuse_home(path: Path, what: str) -> Path:
    p = Path(os.path.abspath(Path(path).expanduser()))
    try:
        real = p.resolve()
    except OSError:
        real = p
    for cand in (p, real):
        if cand == Path("/home") or Path("/home") in cand.parents:
            raise StoreError(f"{what} {path} is under /home: stores belong on a mounted data drive, not in home "
                             f"directories; choose a path outside /home (e.g. /mnt/models or /srv/dgr)")
    return p


def _schema(info: ModelInfo, dtype: str, begin: int) -> BoundarySchema:
    return BoundarySchema(n_streams=info.n_streams, n_embd=info.n_embd, dtype=dtype,
                          token_ids=info.needs_token_ids(begin, begin))


def _stage_kvs(bp: BuildPlan, sp: StagePlan) -> list[bytes]:
    r, info = bp.recipe.recipe, bp.info
    kvs = [kv.raw for key, kv in info.header.kvs.items() if not key.startswith("dgr.")]
    u32 = _VT.UINT32
    ours = [
        (Keys.FORMAT_VERSION, u32, FORMAT_VERSION),
        (Keys.STAGE_INDEX, u32, sp.index),
        (Keys.STAGE_COUNT, u32, len(bp.stages)),
        (Keys.LAYER_BEGIN, u32, sp.begin),
        (Keys.LAYER_END, u32, sp.end),
        (Keys.LAYER_TOTAL, u32, info.n_layer),
        (Keys.SOURCE_NAME, _VT.STRING, r.source.uri),
        (Keys.SOURCE_BLAKE3, _VT.STRING, bp.source_blake3),
        (Keys.RECIPE_NAME, _VT.STRING, r.name),
        (Keys.RECIPE_BLAKE3, _VT.STRING, bp.recipe.blake3),
        (Keys.BOUNDARY_N_STREAMS, u32, info.n_streams),
        (Keys.BOUNDARY_N_EMBD, u32, info.n_embd),
        (Keys.BOUNDARY_DTYPE, _VT.STRING, r.boundary.dtype),
        (Keys.BOUNDARY_TOKEN_IDS, _VT.BOOL, info.needs_token_ids(sp.begin, sp.end)),
    ]
    return kvs + [pack_kv(k, t, v) for k, t, v in ours]


def _write_stage(bp: BuildPlan, sp: StagePlan, src: BinaryIO, out: Path, chunk_size: int,
                 on_bytes: Callable[[int], None]) -> tuple[int, str, list[str]]:
    hasher = _ChunkHasher(chunk_size)
    h: GGUFHeader = bp.info.header
    with open(out, "wb") as f:
        w = StageWriter(f, hasher, h.alignment)
        w.write_header(_stage_kvs(bp, sp), len(sp.tensors))
        w.write_tensor_infos([(t.name, t.shape, q) for t, q in sp.tensors])
        for t, q in sp.tensors:
            start = h.data_offset + t.offset
            if q == t.type:
                def pieces(start: int = start, n: int = t.nbytes):
                    src.seek(start)
                    left = n
                    while left:
                        b = src.read(min(_COPY, left))
                        if not b:
                            raise BundleError(f"{bp.source_path}: ends inside tensor data; the source is truncated")
                        left -= len(b)
                        on_bytes(len(b))
                        yield b
                w.write_tensor(pieces())
            else:
                src.seek(start)
                data = np.frombuffer(src.read(t.nbytes), dtype=np.uint8)
                on_bytes(t.nbytes)
                w.write_tensor([_convert(data, t, q)])
        w.close()
    digest, chunks = hasher.finish()
    return hasher.size, digest, chunks


def stage_filename(index: int, count: int) -> str:
    return f"stage-{index:02d}-of-{count:02d}.gguf"


def build(recipe_path: str | Path, store: str | Path, *, progress: bool = False) -> Bundle:
    """Build the recipe into `store/<name>-<id12>/` and return the loaded bundle."""
    store = refuse_home(Path(store), "store")
    recipe = load_recipe(recipe_path)
    bp = make_plan(recipe, progress=progress)
    r, info = recipe.recipe, bp.info
    chunk = r.bundle.chunk_size
    store.mkdir(parents=True, exist_ok=True)
    tmp = store / f".build-{r.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    total = sum(sp.weight_bytes for sp in bp.stages)
    from tqdm import tqdm

    entries: list[StageEntry] = []
    try:
        with open(bp.source_path, "rb") as src, tqdm(total=total, unit="B", unit_scale=True,
                                                     desc=f"build {r.name}", disable=not progress) as bar:
            for sp in bp.stages:
                name = stage_filename(sp.index, len(bp.stages))
                size, digest, chunks = _write_stage(bp, sp, src, tmp / name, chunk, bar.update)
                last = sp.index == len(bp.stages) - 1
                entries.append(StageEntry(
                    index=sp.index, file=name, size=size, blake3=digest, chunks=chunks,
                    layer_begin=sp.begin, layer_end=sp.end, tensor_count=len(sp.tensors),
                    weight_bytes=sp.weight_bytes,
                    boundary_in=None if sp.index == 0 else _schema(info, r.boundary.dtype, sp.begin),
                    boundary_out=None if last else _schema(info, r.boundary.dtype, sp.end),
                ))
        prov = r.source.provenance.model_dump(exclude_none=True) if r.source.provenance else None
        manifest = Manifest(
            format_version=FORMAT_VERSION,
            recipe=ManifestRecipe(name=r.name, blake3=recipe.blake3, text=recipe.text),
            source=ManifestSource(uri=r.source.uri, blake3=bp.source_blake3,
                                  size=bp.source_path.stat().st_size, provenance=prov),
            model=ManifestModel(arch=info.arch, n_layer=info.n_layer, n_layer_all=info.n_layer_all,
                                n_embd=info.n_embd, n_streams=info.n_streams, n_hash_layers=info.n_hash_layers,
                                tied_embeddings=info.tied_embeddings),
            boundary_dtype=r.boundary.dtype, lanes=list(r.lanes), chunk_size=chunk,
            stages=entries, excluded_tensors=bp.excluded,
        )
        raw = manifest_bytes(manifest)  # sealing: the last step
        (tmp / MANIFEST_NAME).write_bytes(raw)
        bid = blake3.blake3(raw).hexdigest()
        final = store / f"{r.name}-{bid[:12]}"
        if (final / MANIFEST_NAME).is_file() and (final / MANIFEST_NAME).read_bytes() == raw:
            shutil.rmtree(tmp)  # already built (builds are deterministic); leave the existing one in place
        else:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return load_bundle(final)


# ---------------------------------------------------------------- verify

@dataclass
class VerifyReport:
    bundle_id: str
    chunks_total: int
    chunks_read: int = 0
    chunks_skipped: int = 0  # verified by an earlier, interrupted run
    complete: bool = False


def _state_path(b: Bundle, kind: str) -> Path:
    key = blake3.blake3(f"{kind}\0{b.root.resolve()}\0{b.id}".encode()).hexdigest()[:20]
    d = workspace() / "state" / kind
    d.mkdir(parents=True, exist_ok=True)
    return d / f"{key}.json"


def _save_state(path: Path, state: dict) -> None:
    # A per-process temp name: several verifiers of one bundle (workers starting together) may save at once.
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(state, sort_keys=True))
    os.replace(tmp, path)


def _n_chunks(size: int, chunk: int) -> int:
    return -(-size // chunk)


def verify_bundle(path: str | Path, *, resume: bool = True, max_chunks: int | None = None,
                  progress: bool = False) -> VerifyReport:
    """Check every chunk of every stage file; raise BundleError naming the first bad file and chunk.

    Progress is recorded after each chunk, so an interrupted run resumes where it stopped; a file whose
    size or mtime changed since is checked again from its start. `max_chunks` stops early (a budget).
    """
    b = load_bundle(path)
    m = b.manifest
    chunk = m.chunk_size
    spath = _state_path(b, "verify")
    state: dict = {}
    if resume and spath.exists():
        try:
            state = json.loads(spath.read_text())
        except (OSError, ValueError):
            state = {}
    rep = VerifyReport(bundle_id=b.id, chunks_total=sum(len(s.chunks) for s in m.stages))
    from tqdm import tqdm

    bar = tqdm(total=rep.chunks_total, unit="chunk", desc="verify", disable=not progress)
    try:
        for s in m.stages:
            p = b.root / s.file
            if not p.is_file():
                raise BundleError(f"{p}: stage {s.index} file is missing; re-provision the bundle")
            st = p.stat()
            if st.st_size != s.size:
                first_bad = min(st.st_size, s.size) // chunk
                raise BundleError(f"{p}: size {st.st_size} bytes, manifest says {s.size}: the file is "
                                  f"{'truncated' if st.st_size < s.size else 'too long'}; first bad chunk "
                                  f"{first_bad} (bytes {first_bad * chunk}-); re-provision the bundle")
            rec = state.get(s.file)
            start = 0
            if rec and rec.get("size") == st.st_size and rec.get("mtime_ns") == st.st_mtime_ns:
                start = int(rec.get("chunks_ok", 0))
            rep.chunks_skipped += start
            bar.update(start)
            with open(p, "rb") as f:
                f.seek(start * chunk)
                for k in range(start, len(s.chunks)):
                    if max_chunks is not None and rep.chunks_read >= max_chunks:
                        return rep
                    data = f.read(chunk)
                    rep.chunks_read += 1
                    if blake3.blake3(data).hexdigest() != s.chunks[k]:
                        raise BundleError(f"{p}: chunk {k} (bytes {k * chunk}-{k * chunk + len(data) - 1}) does "
                                          f"not match the manifest: the file is corrupt; re-provision the bundle")
                    state[s.file] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "chunks_ok": k + 1}
                    _save_state(spath, state)
                    bar.update(1)
    finally:
        bar.close()
    rep.complete = True
    spath.unlink(missing_ok=True)  # a finished check starts afresh next time
    return rep


# ---------------------------------------------------------------- provision

@dataclass
class ProvisionReport:
    dest: Path
    bundle_id: str
    chunks_total: int
    chunks_copied: int = 0
    chunks_reused: int = 0   # already in the store from an earlier (interrupted) run, re-hashed
    complete: bool = False


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
        have = 0
        if part.exists():
            with open(part, "rb") as f:
                while have < len(s.chunks):
                    data = f.read(chunk)
                    if not data or blake3.blake3(data).hexdigest() != s.chunks[have]:
                        break
                    have += 1
            with open(part, "r+b") as f:
                f.truncate(min(have * chunk, s.size))
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
                if blake3.blake3(data).hexdigest() != s.chunks[k]:
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
