"""What a deployment's bundle is (a recipe or a bundle id): its stages, their weights, where copies sit.

A recipe's bundle is recognised in a store by its manifest (the recipe's name and the blake3 of the
recipe's exact bytes, which name the source model by its blake3 too); a bundle id by the manifest's id.
Nothing here builds or copies anything: that is `dgr.app.deploy.provision`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dgr.app.deploy.spec import LoadedDeployment
from dgr.core.errors import DgrError
from dgr.toolchain.bundle import make_plan, weights
from dgr.toolchain.bundle.manifest import load_bundle
from dgr.toolchain.recipe import load_recipe


@dataclass
class BundleInfo:
    """`ranges`/`weights` per stage (weights None when unknown without the model); `copies`: store ->
    the bundle folder in it; `source`: a whole copy to provision from; `problem`: why it is unusable."""

    label: str
    name: str = ""
    ranges: list[tuple[int, int]] = field(default_factory=list)
    weights: list[int] | None = None
    id: str | None = None
    recipe_path: Path | None = None
    recipe_blake3: str | None = None
    source: Path | None = None
    copies: dict[Path, Path] = field(default_factory=dict)
    problem: str | None = None

    def folder_in(self, store: Path) -> Path | None:
        """Where the bundle is (or will be, once its id is known) in `store`."""
        if store in self.copies:
            return self.copies[store]
        return store / f"{self.name}-{self.id[:12]}" if self.id and self.name else None


def _manifests(store: Path):
    """(folder, bundle) of every whole bundle in `store` (a folder with a valid manifest)."""
    if not store.is_dir():
        return
    for d in sorted(store.iterdir()):
        if d.is_dir() and not d.name.startswith(".") and (d / "manifest.json").is_file():
            try:
                yield d, load_bundle(d)
            except DgrError:
                continue


def _bundles_at(place: Path):
    """A bundle folder itself, or the bundles in a store."""
    if (place / "manifest.json").is_file():
        try:
            yield place, load_bundle(place)
        except DgrError:
            return
    else:
        yield from _manifests(place)


def _take(info: BundleInfo, b) -> None:
    m = b.manifest
    info.id, info.name = b.id, m.recipe.name
    info.ranges = [(s.layer_begin, s.layer_end) for s in m.stages]
    info.weights = [s.weight_bytes for s in m.stages]


def resolve_bundle(ld: LoadedDeployment, stores: list[Path]) -> BundleInfo:
    """The bundle of `ld` and its copies among `stores` (the hosts' stores that this machine can read)."""
    ref = ld.deployment.bundle
    if ref.recipe is not None:
        return _from_recipe(ld.resolve(ref.recipe), stores)
    return _from_id(ref.id, ld.resolve(ref.source) if ref.source else None, stores)


def _from_recipe(path: Path, stores: list[Path]) -> BundleInfo:
    info = BundleInfo(label=f"the bundle of recipe {path}")
    rpath = path / "recipe.toml" if path.is_dir() else path
    try:
        lr = load_recipe(rpath)
    except DgrError as e:
        info.problem = f"bundle.recipe: {e}"
        return info
    r = lr.recipe
    info.name, info.recipe_path, info.recipe_blake3 = r.name, rpath, lr.blake3
    if r.placement.stages is not None:
        info.ranges = [tuple(p) for p in r.placement.stages]
    for store in stores:
        for d, b in _manifests(store):
            if b.manifest.recipe.name == r.name and b.manifest.recipe.blake3 == lr.blake3:
                info.copies[store] = d
                _take(info, b)
                info.source = info.source or d
                break
    return info


def _from_id(bid: str, source: Path | None, stores: list[Path]) -> BundleInfo:
    info = BundleInfo(label=f"bundle {bid[:12]}")
    places = ([source] if source else []) + list(stores)
    for store in places:
        for d, b in _bundles_at(store):
            if b.id.startswith(bid):
                _take(info, b)
                if d.parent in stores:
                    info.copies[d.parent] = d
                info.source = info.source or d
    if info.id is None:
        where = f"bundle.source {source} nor " if source else ""
        info.problem = (f"bundle.id {bid}: no bundle with this id in {where}any host store this machine can read "
                        f"({', '.join(str(s) for s in stores) or 'none'}); set bundle.source to a folder holding it "
                        "(`dgr recipe build` output) or provision it first (`dgr bundle provision`)")
    return info


def fill_from_model(info: BundleInfo) -> tuple[list[int], int, int, int] | None:
    """Plan the recipe's stages from its source model (resolved into the download cache): sets
    `ranges` and `weights` where no built copy said them, and returns the planner's inputs (bytes per
    layer, input-only, output-only and shared bytes). None when there is no recipe."""
    if info.recipe_path is None:
        return None
    bp = make_plan(load_recipe(info.recipe_path))
    if not info.ranges:
        info.ranges = [(sp.begin, sp.end) for sp in bp.stages]
    if info.weights is None:
        info.weights = [sp.weight_bytes for sp in bp.stages]
    # the bundle's own measure (dgr.toolchain.bundle.weights), each tensor at the type the build gives it
    w = weights(bp.info, {t.name: q for sp in bp.stages for t, q in sp.tensors})
    return w.layer_bytes, w.input_bytes, w.output_bytes, w.shared_bytes
