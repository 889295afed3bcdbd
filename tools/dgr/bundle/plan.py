"""Build planning: a loaded recipe to the stages of a bundle, without writing anything.

A plan holds each stage's range, its tensors with their target types, and its contract.

Placement is either the recipe's explicit ranges or the planner's answer for its workers; every
tensor then goes to the stages that own it (a layer's tensors to the stage holding that layer, the
token embedding to the first, the head to the last, shared tables to all; MTP layers to none).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf

from dgr.bundle.quantize import check_conversion, target_type
from dgr.contract import StageContract, wire_dtype
from dgr.errors import BundleError, RecipeError
from dgr.ggufmodel import INPUT, OUTPUT, SHARED, ModelInfo, TensorInfo, model_info, tensor_nbytes
from dgr.log import get_logger
from dgr.planner import WorkerSpec, plan
from dgr.recipe import LoadedRecipe, boundary_dtype_warning, check_ranges
from dgr.source import resolve

log = get_logger(__name__)


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

    def contract(self, sp: StagePlan) -> StageContract:
        """What stage `sp` takes and gives at its seams, in the recipe's wire dtype."""
        return self.info.stage_contract(sp.begin, sp.end, dtype=self.recipe.recipe.boundary.dtype)


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


def _check_source(src: Path, info: ModelInfo) -> None:
    n_split = info.header.get(gguf.Keys.Split.LLM_KV_SPLIT_COUNT, 1)
    if n_split and int(n_split) > 1:
        raise BundleError(f"{src}: is part 1 of a {n_split}-file split GGUF; dgr reads single-file models: "
                          f"merge it first (llama-gguf-split --merge) and point source.uri at the merged file")
    if info.unknown:
        raise BundleError(f"{src}: tensors that belong to no layer dgr understands: {info.unknown[:10]}"
                          f"{' ...' if len(info.unknown) > 10 else ''}; dgr cannot place them in a stage "
                          f"(teach dgr.ggufmodel.classify about them)")


def _ranges(recipe: LoadedRecipe, info: ModelInfo, layer_bytes: list[int], role: dict[str, int]) -> list[tuple[int, int]]:
    r = recipe.recipe
    if r.placement.stages is not None:
        ranges = list(r.placement.stages)
        try:
            check_ranges(ranges, info.n_layer)
        except ValueError as e:
            raise RecipeError(f"{recipe.path}: placement.stages: {e} (model {info.arch}, {info.n_layer} layers)") from None
        return ranges
    workers = [WorkerSpec(w.name, int(w.memory), w.speed) for w in r.placement.workers or []]
    try:
        return list(plan(layer_bytes, workers, input_bytes=role[INPUT], output_bytes=role[OUTPUT],
                         shared_bytes=role[SHARED]).ranges)
    except RecipeError as e:
        raise RecipeError(f"{recipe.path}: {e}") from None


def _check_boundary_dtype(recipe: LoadedRecipe, info: ModelInfo) -> None:
    """The recipe's [boundary] dtype against this model: whole blocks per token (RecipeError), and the
    measured loss of that dtype on this architecture (a warning: `dgr recipe plan` and `build` both)."""
    dtype = recipe.recipe.boundary.dtype
    try:
        wire_dtype(dtype).check(info.n_streams * info.n_embd)
    except ValueError as e:
        raise RecipeError(f"{recipe.path}: boundary.dtype: {e} (model {info.arch}, boundary "
                          f"[n, {info.n_streams}, {info.n_embd}])") from None
    why = boundary_dtype_warning(info.arch, dtype)
    if why:
        log.warning("warning: %s: %s", recipe.path, why)


def make_plan(recipe: LoadedRecipe, *, progress: bool = False) -> BuildPlan:
    """Resolve the recipe's source and plan its stages (raises RecipeError / BundleError naming the fix)."""
    r = recipe.recipe
    src = resolve(r.source.uri, r.source.blake3, base_dir=recipe.path.parent, progress=progress)
    info = model_info(src)
    _check_source(src, info)
    _check_boundary_dtype(recipe, info)
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
    ranges = _ranges(recipe, info, layer_bytes, role)
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
