"""`build`: a recipe into a bundle folder in a store, streaming and deterministic; `find_or_build`: the same
bundle found again in the store by its recipe's blake3, built only when it is not there.

The steps run in order: plan, write each stage file (hashing as it is written), seal the manifest,
move the folder into place.

Building is streaming (tensor data is copied in pieces; only a tensor being re-quantized is held in
memory) and deterministic (no timestamps, no absolute paths; the same recipe and source give the same
bytes). Everything is written in a hidden folder (`.build-NAME-PID`) renamed last, after the manifest is
sealed, so a store folder `NAME-ID12` is always a whole bundle. A store without room for the tensor data
fails before writing; a disk that fills up meanwhile ends in a StoreError (what, how much, what to do)
and the partial build is removed.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import BinaryIO, Callable

import gguf
import numpy as np
from tqdm import tqdm

from dgr.core.constants import FORMAT_VERSION, MANIFEST_NAME, Keys
from dgr.core.contract import StageContract
from dgr.core.errors import BundleError
from dgr.core.hashing import ChunkHasher
from dgr.core.log import get_logger
from dgr.toolchain.bundle.manifest import (Bundle, Manifest, ManifestModel, ManifestRecipe, ManifestSource, StageEntry,
                                           bundle_id, load_bundle, manifest_bytes, stage_filename)
from dgr.toolchain.bundle.plan import BuildPlan, StagePlan, make_plan
from dgr.toolchain.bundle.quantize import convert
from dgr.toolchain.bundle.store import disk_full, free_bytes, no_space, refuse_home
from dgr.toolchain.bundle.writer import StageWriter, pack_kv
from dgr.toolchain.recipe import load_recipe

log = get_logger(__name__)

_COPY = 4 * 1024 * 1024  # bytes per piece when a tensor is copied unchanged
_VT = gguf.GGUFValueType
# Every dgr key lives under this prefix (dgr.core.constants.Keys): a source's own dgr keys (it may be a
# stage of another bundle) are dropped and replaced by this build's.
_DGR_PREFIX = "dgr."


def _stage_kvs(bp: BuildPlan, sp: StagePlan, c: StageContract) -> list[bytes]:
    r, info = bp.recipe.recipe, bp.info
    kvs = [kv.raw for key, kv in info.header.kvs.items() if not key.startswith(_DGR_PREFIX)]
    u32 = _VT.UINT32
    ours = [
        (Keys.FORMAT_VERSION, u32, FORMAT_VERSION),
        (Keys.STAGE_INDEX, u32, sp.index),
        (Keys.STAGE_COUNT, u32, len(bp.stages)),
        (Keys.LAYER_BEGIN, u32, c.layer_begin),
        (Keys.LAYER_END, u32, c.layer_end),
        (Keys.LAYER_TOTAL, u32, c.n_layer),
        (Keys.SOURCE_NAME, _VT.STRING, r.source.uri),
        (Keys.SOURCE_BLAKE3, _VT.STRING, bp.source_blake3),
        (Keys.RECIPE_NAME, _VT.STRING, r.name),
        (Keys.RECIPE_BLAKE3, _VT.STRING, bp.recipe.blake3),
        (Keys.BOUNDARY_N_STREAMS, u32, c.n_streams),
        (Keys.BOUNDARY_N_EMBD, u32, c.n_embd),
        (Keys.BOUNDARY_DTYPE, _VT.STRING, c.dtype),
        (Keys.BOUNDARY_TOKEN_IDS, _VT.BOOL, c.token_ids_in),
    ]
    if r.bundle.include_mtp and sp.index == len(bp.stages) - 1:
        ours.append((Keys.MTP, _VT.BOOL, True))     # only there: stages without MTP stay byte for byte as before
    return kvs + [pack_kv(k, t, v) for k, t, v in ours]


def _write_stage(bp: BuildPlan, sp: StagePlan, src: BinaryIO, out: Path, chunk_size: int,
                 on_bytes: Callable[[int], None]) -> tuple[int, str, list[str]]:
    hasher = ChunkHasher(chunk_size)
    h = bp.info.header
    with open(out, "wb") as f:
        w = StageWriter(f, hasher, h.alignment)
        w.write_header(_stage_kvs(bp, sp, bp.contract(sp)), len(sp.tensors))
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
                out_data = convert(data, t, q)
                on_bytes(memoryview(out_data).nbytes)  # the bar's total counts bytes written
                w.write_tensor([out_data])
        w.close()
    digest, chunks = hasher.finish()
    return hasher.size, digest, chunks


def _manifest(bp: BuildPlan, entries: list[StageEntry], chunk: int) -> Manifest:
    recipe, info = bp.recipe, bp.info
    r = recipe.recipe
    prov = r.source.provenance.model_dump(exclude_none=True) if r.source.provenance else None
    return Manifest(
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


def build(recipe_path: str | Path, store: str | Path, *, progress: bool = False) -> Bundle:
    """Build the recipe into `store/<name>-<id12>/` and return the loaded bundle."""
    store = refuse_home(Path(store), "store")
    recipe = load_recipe(recipe_path)
    bp = make_plan(recipe, progress=progress)
    if progress:
        for use in bp.quantization:
            log.info("quantization: %s", use.line())
    r = recipe.recipe
    chunk = int(r.bundle.chunk_size)
    total = sum(sp.weight_bytes for sp in bp.stages)   # tensor data: a lower bound of what is written
    gone = "Nothing of the build was kept."
    try:
        store.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if no_space(e):
            raise disk_full(store, f"creating {store}", total, gone, at_least=True) from None
        raise
    if total > free_bytes(store):
        raise disk_full(store, "checking for room before building", total, "Nothing was written.", at_least=True)
    tmp = store / f".build-{r.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    entries: list[StageEntry] = []
    writing = tmp
    try:
        tmp.mkdir()
        with open(bp.source_path, "rb") as src, tqdm(total=total, unit="B", unit_scale=True,
                                                     desc=f"build {r.name}", disable=not progress) as bar:
            for sp in bp.stages:
                name = stage_filename(sp.index, len(bp.stages))
                writing = tmp / name
                size, digest, chunks = _write_stage(bp, sp, src, tmp / name, chunk, bar.update)
                c = bp.contract(sp)
                entries.append(StageEntry(
                    index=sp.index, file=name, size=size, blake3=digest, chunks=chunks,
                    layer_begin=sp.begin, layer_end=sp.end, tensor_count=len(sp.tensors),
                    weight_bytes=sp.weight_bytes, boundary_in=c.boundary_in, boundary_out=c.boundary_out,
                ))
        raw = manifest_bytes(_manifest(bp, entries, chunk))  # sealing: the last step
        writing = tmp / MANIFEST_NAME
        writing.write_bytes(raw)
        final = store / f"{r.name}-{bundle_id(raw)[:12]}"
        if (final / MANIFEST_NAME).is_file() and (final / MANIFEST_NAME).read_bytes() == raw:
            shutil.rmtree(tmp)  # already built (builds are deterministic); leave the existing one in place
        else:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if no_space(e):
            raise disk_full(store, f"writing {e.filename or writing}", total, gone, at_least=True) from None
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return load_bundle(final)


def find_or_build(recipe_path: str | Path, store: str | Path, *, progress: bool = False) -> Bundle:
    """The recipe's bundle in `store`: a folder `<name>-*` there whose manifest names the recipe's blake3, or
    else `build` it there. A half-written or foreign folder of that name is not a match (it is skipped)."""
    recipe = load_recipe(recipe_path)
    for manifest in sorted(Path(store).glob(f"{recipe.recipe.name}-*/{MANIFEST_NAME}")):
        try:
            b = load_bundle(manifest.parent)
        except Exception:   # a half-written or foreign folder: not ours, build a fresh one
            continue
        if b.manifest.recipe.blake3 == recipe.blake3:
            return b
    log.info("building bundle %s into %s", recipe.recipe.name, store)
    return build(recipe.path, store, progress=progress)
