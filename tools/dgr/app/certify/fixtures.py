"""The bundles the gate certifies: built from committed recipes, or from random-weight models it writes itself.

A synthetic target of the contract (`[[gate.synthetic]]`) becomes a source GGUF from `dgr synth`
(deterministic: the same arguments give the same bytes, so the same bundle id), a recipe that names it
by path and blake3 with the contract's stage ranges, and a bundle built by dgr.toolchain.bundle.build. Built
bundles are found again by their recipe's blake3. Every recipe is read (and an MTP-on one refused)
before anything is written or built.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from dgr.app.certify.contract import Synthetic, mtp_refused
from dgr.core.certificate import Figure
from dgr.core.errors import RecipeError
from dgr.core.hashing import file_blake3
from dgr.core.paths import REPO_ROOT, workspace
from dgr.toolchain.bundle import find_or_build
from dgr.toolchain.recipe import load_recipe
from dgr.toolchain.synth.deepseek4 import synth_deepseek4, synth_deepseek4_v4shape
from dgr.toolchain.synth.generic import synth


def certify_root() -> Path:
    """Where the gate keeps what it writes (synthetic sources, recipes, bundles): the workspace."""
    return workspace() / "certify"


def default_store() -> Path:
    return Path(os.environ.get("DGR_STORE") or workspace() / "store")


def bundle_for_recipe(recipe_path: str | Path, store: Path | None = None, *, progress: bool = False,
                      allow_mtp: bool = False):
    """The bundle of a recipe: read it first (an MTP-on recipe raises RecipeError here, before anything
    is written: alpha certifies MTP off; beta's MTP rows pass `allow_mtp`), then find it in `store` by the
    recipe's blake3, or build it there (dgr.toolchain.bundle.find_or_build)."""
    p = Path(recipe_path)
    if not p.is_absolute() and not p.exists():
        p = REPO_ROOT / p
    recipe = load_recipe(p / "recipe.toml" if p.is_dir() else p)
    if recipe.recipe.bundle.include_mtp and not allow_mtp:
        raise RecipeError(mtp_refused(str(recipe.path)))
    return find_or_build(recipe.path, store or default_store(), progress=progress)


def synth_source(spec: Synthetic, root: Path | None = None) -> Path:
    """The random-weight source GGUF of `spec` (written once; the file name says its arguments)."""
    d = (root or certify_root()) / "sources"
    mtp = spec.mtp and spec.arch == "deepseek4"
    name = (f"{spec.arch}-L{spec.layers}{'+mtp' if mtp else ''}-H{spec.hash_layers}-E{spec.embd}"
            f"-s{spec.seed}{'-v4shape' if spec.v4shape else ''}.gguf")
    path = d / name
    if path.is_file():
        return path
    tmp = d / f".{name}.{os.getpid()}.tmp"
    d.mkdir(parents=True, exist_ok=True)
    if spec.arch == "deepseek4":
        if spec.v4shape:
            if (spec.layers, spec.hash_layers, spec.mtp) != (43, 3, True):
                raise RecipeError(f"gate.synthetic {spec.name}: v4shape is V4's 43 layers + MTP with 3 hash layers")
            synth_deepseek4_v4shape(tmp, seed=spec.seed, embd=spec.embd)
        else:
            synth_deepseek4(tmp, layers=spec.layers, embd=spec.embd, seed=spec.seed, hash_layers=spec.hash_layers,
                            mtp=spec.mtp)
    else:
        synth(spec.arch, spec.layers, spec.embd, spec.seed, tmp)
    tmp.replace(path)
    return path


def synth_recipe(spec: Synthetic, root: Path | None = None, *, include_mtp: bool = False) -> Path:
    """Write the recipe of a synthetic target (its source by path and blake3, its stage ranges)."""
    src = synth_source(spec, root)
    d = (root or certify_root()) / "recipes"
    d.mkdir(parents=True, exist_ok=True)
    name = spec.name + ("-mtp-on" if include_mtp else "")
    pairs = ", ".join(f"[{a}, {b}]" for a, b in spec.stages)
    text = (f'# Written by `dgr gate alpha` from the contract\'s [[gate.synthetic]] "{spec.name}".\n'
            f'name = "{name}"\ndescription = "random-weight {spec.arch}, {spec.layers} layers, '
            f'{len(spec.stages)} stages"\nlanes = ["cpu"]\n\n'
            f'[source]\nuri = "{src}"\nblake3 = "{file_blake3(src)}"\n\n'
            f"[placement]\nstages = [{pairs}]\n\n[boundary]\ndtype = \"f32\"\n")
    if include_mtp:
        text += "\n[bundle]\ninclude_mtp = true\n"
    path = d / f"{name}.toml"
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
    return path


def synthetic_bundle(spec: Synthetic, root: Path | None = None, *, include_mtp: bool = False):
    """The bundle of a synthetic target (with its MTP block on the last stage: `include_mtp`, beta only)."""
    root = root or certify_root()
    return bundle_for_recipe(synth_recipe(spec, root, include_mtp=include_mtp), root / "store", allow_mtp=include_mtp)


def mtp_refusal(spec: Synthetic, root: Path | None = None) -> Figure:
    """Write `spec`'s recipe with MTP turned on and hand it to the bundle step: it must be refused while
    the recipe is read (no store folder made, no bundle built, no worker started)."""
    root = root or certify_root()
    recipe = synth_recipe(spec, root, include_mtp=True)
    store = root / "mtp-refusal-store"
    if store.exists():
        shutil.rmtree(store)
    try:
        b = bundle_for_recipe(recipe, store)
    except RecipeError as e:
        msg = str(e)
        ok = "MTP" in msg and not store.exists()
        last = msg.strip().splitlines()[-1].strip()      # "<recipe>: MTP is on (bundle.include_mtp): alpha ..."
        why = "bundle.include_mtp" if "bundle.include_mtp" in last else last.split(":", 1)[0]
        return Figure(check="MTP-on recipe refused", figure=f"refused ({why})",
                      threshold="refused before anything runs", passed=ok,
                      detail=f"{recipe.name}: {last}" + ("" if ok else "; the store was written"))
    return Figure(check="MTP-on recipe refused", figure=f"built {b.root}", threshold="refused before anything runs",
                  passed=False)
