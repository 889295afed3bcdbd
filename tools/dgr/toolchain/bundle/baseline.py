"""`baseline_model`: the whole model a bundle's split run is compared with, for `dgr parity` and `dgr certify`.

Parity means the split runs exactly what the whole model with the same weights runs. When every tensor of
the bundle has its source's type, those weights are the source GGUF's, and the source (verified by the
caller against the manifest's blake3) is the baseline. When the recipe quantized, no file holds those
weights whole: the baseline is then the same recipe built as one stage (`placement.stages = [[0, n_layer]]`,
every other field as recorded in the manifest) by `build`, the builder every bundle goes through; the engine
opens that one file as the whole model (it owns every layer), as it opens the source.

It is built once into the workspace, `baselines/<key16>/` (`recipe.toml`, `store/<name>-<id12>/`), keyed by
the blake3 of that one-stage recipe without its source path (which is this machine's: the source is
named by its blake3), so every later parity or certify of a bundle of the same recipe and quantization
reuses it after checking its stage file's blake3.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import tomli_w

from dgr.core.errors import BundleError, DgrError
from dgr.core.hashing import bytes_blake3, file_blake3
from dgr.core.locks import locked
from dgr.core.log import get_logger
from dgr.core.paths import workspace
from dgr.gguf.model import read_header
from dgr.toolchain.bundle.builder import build
from dgr.toolchain.bundle.manifest import Bundle, canonical_json, load_bundle
from dgr.toolchain.recipe import Placement, parse_recipe

log = get_logger(__name__)

BASELINES_DIRNAME = "baselines"   # under the workspace: one folder per one-stage recipe
_KEY_HEX = 16                     # hex digits of the key in the folder name (64 bits tell recipes apart)


@dataclass(frozen=True)
class Baseline:
    """The whole-model GGUF a split is compared with, and what it is (`str()` says so, for the output)."""

    path: Path
    built: bool   # True: the recipe built as one stage; False: the bundle's source GGUF

    def __str__(self) -> str:
        return f"the recipe built as one stage: {self.path}" if self.built else f"the source GGUF {self.path}"


def retyped_tensors(bundle: Bundle, source: str | Path) -> list[str]:
    """The tensors of `bundle`'s stages whose type is not the source's (what its recipe quantized)."""
    src = {t.name: t.type for t in read_header(source).tensors}
    return sorted({t.name for p in bundle.stage_paths for t in read_header(p).tensors if src.get(t.name) != t.type})


def baseline_model(bundle: Bundle, source: str | Path, *, progress: bool = False) -> Baseline:
    """The whole model `bundle` must equal: its source GGUF (`source`, already verified by the caller) when
    no stage tensor's type differs from the source's; otherwise the recipe built as one stage (built into
    the workspace once, reused after). BundleError when no such baseline can run (a model with MTP blocks)."""
    source = Path(source)
    retyped = retyped_tensors(bundle, source)
    if not retyped:
        return Baseline(source, built=False)
    m = bundle.manifest
    n_mtp = m.model.n_layer_all - m.model.n_layer
    if n_mtp:
        # The engine's whole-model path loads every block the header counts, and a bundle leaves the MTP
        # blocks out (include_mtp is off for alpha): llama.cpp refuses the one-stage file. A split bundle
        # loads (each stage owns a range), so only this comparison is missing.
        raise BundleError(
            f"{bundle.root}: {len(retyped)} tensors are quantized ({retyped[0]}, ...), so the whole model to "
            f"compare with is the recipe built as one stage; but {m.model.arch} here has {n_mtp} MTP block(s) "
            f"(layers [{m.model.n_layer}, {m.model.n_layer_all})), which every bundle leaves out, and llama.cpp "
            f"cannot load a one-stage bundle without them (`blk.{m.model.n_layer}.attn_norm.weight not found`). "
            "A quantized bundle of a model with MTP blocks cannot be checked yet; check the same placement "
            "without [quantization] (its baseline is the source)")
    recipe_text, key = one_stage_recipe(bundle, source)
    home = _baselines_dir() / key[:_KEY_HEX]

    with locked(home / ".lock"):                     # two parity runs build it once
        found = _built(home, m.source.blake3)
        if found is None:
            store = home / "store"
            log.info("baseline: %d of the bundle's tensors are quantized (%s, ...): building the recipe as one "
                     "stage into %s (once; later runs reuse it)", len(retyped), retyped[0], store)
            if store.exists():
                shutil.rmtree(store)                 # a damaged earlier build (see _built)
            path = home / "recipe.toml"
            path.write_text(recipe_text)

            found = build(path, store, progress=progress)
            log.info("baseline: built %s", found.root)
        else:
            log.info("baseline: the recipe built as one stage, built earlier: %s", found.root)
    one = found.stage_paths[0]
    _check_same_types(bundle, one)
    return Baseline(one, built=True)


def one_stage_recipe(bundle: Bundle, source: Path) -> tuple[str, str]:
    """(TOML text, key): the bundle's recipe with `placement.stages = [[0, n_layer]]` and `source.uri` the
    local `source`; the key is the blake3 of that recipe without its uri."""
    m = bundle.manifest
    r = parse_recipe(m.recipe.text, f"{bundle.root}/manifest.json recipe")
    one = r.model_copy(update={"placement": Placement(stages=[[0, m.model.n_layer]]),
                               "source": r.source.model_copy(update={"uri": str(source.resolve())})})
    data = one.model_dump(mode="json", exclude_none=True)
    text = tomli_w.dumps(data)
    if parse_recipe(text, "<one-stage recipe>") != one:   # TOML writes what the model holds, or we stop here
        raise DgrError(f"{bundle.root}: the recipe written as one stage does not read back the same; "
                       "report this with the bundle's manifest.json")
    data["source"].pop("uri")
    return text, bytes_blake3(canonical_json(data))


def _baselines_dir() -> Path:
    return workspace() / BASELINES_DIRNAME


def _built(home: Path, source_blake3: str) -> Bundle | None:
    """The one-stage bundle built earlier in `home`, when it is whole: one stage of the same source, whose
    file still has the blake3 its manifest records (None otherwise: it is built again)."""
    for manifest in sorted((home / "store").glob("*/manifest.json")):
        if manifest.parent.name.startswith("."):
            continue                                 # a build that stopped before its rename
        try:
            b = load_bundle(manifest.parent)
        except DgrError:
            continue
        s = b.manifest.stages
        if len(s) == 1 and b.manifest.source.blake3 == source_blake3 and b.stage_paths[0].is_file() \
                and file_blake3(b.stage_paths[0]) == s[0].blake3:
            return b
        log.info("baseline: %s is not a whole one-stage build of this recipe; building it again", b.root)
    return None


def _check_same_types(bundle: Bundle, one: Path) -> None:
    """Every tensor of the split has the same type in the one-stage file: a bundle built by a dgr whose
    quantization rules differed from this one's would otherwise fail parity for a reason it does not say."""
    whole = {t.name: t.type for t in read_header(one).tensors}
    for p in bundle.stage_paths:
        for t in read_header(p).tensors:
            if whole.get(t.name) != t.type:
                got = whole[t.name].name if t.name in whole else "absent"
                raise BundleError(f"{p}: tensor {t.name} is {t.type.name}, but the same recipe built as one stage "
                                  f"now makes it {got} ({one}): the bundle was built by another dgr; rebuild it "
                                  "(`dgr recipe build`) and check again")
