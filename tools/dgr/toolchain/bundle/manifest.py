"""The bundle manifest: its pydantic model, its canonical JSON (the bundle id) and `load_bundle`.

`load_bundle` reads and validates a bundle folder for workers; the bundle id is the blake3 of the
canonical manifest, which is also the exact content of `manifest.json`.

The bytes of `manifest_bytes` are the bundle's identity: field names, their order inside each model
and the JSON form (`canonical_json`) must not change without a new FORMAT_VERSION.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from dgr.core.constants import FORMAT_VERSION, MANIFEST_NAME
from dgr.core.contract import STRICT, BoundarySchema
from dgr.core.errors import BundleError, first_field_error
from dgr.core.hashing import bytes_blake3


class StageEntry(BaseModel):
    model_config = STRICT
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
    model_config = STRICT
    name: str
    blake3: str
    text: str


class ManifestSource(BaseModel):
    model_config = STRICT
    uri: str
    blake3: str
    size: int
    provenance: dict[str, str] | None


class ManifestModel(BaseModel):
    model_config = STRICT
    arch: str
    n_layer: int
    n_layer_all: int
    n_embd: int
    n_streams: int
    n_hash_layers: int
    tied_embeddings: bool


class Manifest(BaseModel):
    model_config = STRICT
    format_version: int
    recipe: ManifestRecipe
    source: ManifestSource
    model: ManifestModel
    boundary_dtype: str
    lanes: list[str]
    chunk_size: int
    stages: list[StageEntry]
    excluded_tensors: list[str]  # MTP layers left out (bundle.include_mtp off); [] when the last stage has them


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def manifest_bytes(m: Manifest) -> bytes:
    return canonical_json(m.model_dump(mode="json"))


def bundle_id(raw: bytes) -> str:
    """The id of the bundle whose canonical manifest is `raw`."""
    return bytes_blake3(raw)


def stage_filename(index: int, count: int) -> str:
    return f"stage-{index:02d}-of-{count:02d}.gguf"


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


# The shortest id prefix `check_id` takes: 8 hex digits (32 bits) tell bundles apart; fewer would
# accept one bundle in a few hundred by chance. Listings show 12 (`NAME-ID12` store folders).
MIN_ID_PREFIX = 8
_HEX = set("0123456789abcdef")


def check_id(b: Bundle, expect: str) -> None:
    """BundleError unless `expect` is bundle `b`'s id as listings show it: the whole id, any prefix of it of
    at least MIN_ID_PREFIX hex digits (the 12-digit short id included), or the store folder name NAME-ID12."""
    want = expect.strip().lower()
    name = f"{b.manifest.recipe.name}-".lower()
    if want.startswith(name) and len(want) > len(name):
        want = want[len(name):]  # the store folder's name: NAME-ID12
    if not want or not set(want) <= _HEX or len(want) > len(b.id):
        raise BundleError(f"expected id {expect!r} is not a bundle id: give the id (64 hex digits) or a prefix of "
                          f"it, as `dgr recipe build` and the store's NAME-ID12 folders show it; this bundle is "
                          f"{b.id} ({b.id[:12]})")
    if len(want) < MIN_ID_PREFIX:
        raise BundleError(f"expected id {expect!r} is too short to tell bundles apart: give at least "
                          f"{MIN_ID_PREFIX} hex digits (listings show 12, e.g. {b.id[:12]})")
    if not b.id.startswith(want):
        raise BundleError(f"{b.root}: bundle id is {b.id} (short {b.id[:12]}), expected {expect} "
                          f"({'a prefix of the id' if len(want) < len(b.id) else 'the whole id'}): this is "
                          f"not the bundle you asked for; provision the expected one, or check the id you gave")


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
        raise BundleError(f"{mpath}: not a valid dgr manifest: {first_field_error(e)}") from e
    if m.format_version != FORMAT_VERSION:
        raise BundleError(f"{mpath}: format_version {m.format_version}, this dgr reads {FORMAT_VERSION}; use a matching dgr")
    if manifest_bytes(m) != raw:
        raise BundleError(f"{mpath}: the manifest is not in canonical form (was it edited?); rebuild or re-provision the bundle")
    for s in m.stages:
        if Path(s.file).name != s.file or s.file in ("", ".", ".."):
            raise BundleError(f"{mpath}: stage {s.index} file {s.file!r} is not a plain file name")
    return Bundle(root=mpath.parent, manifest=m, id=bundle_id(raw))
