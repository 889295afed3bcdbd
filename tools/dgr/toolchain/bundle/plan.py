"""Build planning: a loaded recipe to the stages of a bundle, without writing anything.

A plan holds each stage's range, its tensors with their target types, its contract, and what each
quantization rule did (the tensors it converts, the ones it matched that llama.cpp never quantizes).

Placement is either the recipe's explicit ranges or the planner's answer for its workers; every
tensor then goes to the stages that own it (a layer's tensors to the stage holding that layer, the
token embedding to the first, the head to the last, shared tables to all; MTP layers to none).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf

from dgr.core.contract import StageContract, wire_dtype
from dgr.core.errors import BundleError, RecipeError
from dgr.core.log import get_logger
from dgr.gguf.model import INPUT, OUTPUT, SHARED, ModelInfo, TensorInfo, model_info, tensor_nbytes
# Weights and weights are also dgr.toolchain.bundle's face (its __init__ finds them here)
from dgr.gguf.weights import Weights, mtp_needs_embedding_copy, mtp_tensors, weights  # noqa: F401
from dgr.toolchain.bundle.quantize import Choice, check_target, choose
from dgr.toolchain.planner import WorkerSpec, plan
from dgr.toolchain.recipe import KEEP, LoadedRecipe, boundary_dtype_warning, check_ranges
from dgr.toolchain.source import resolve

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
class RuleUse:
    """What one entry of the recipe's [quantization] did: the tensors it gives its type, and the tensors it
    matched that keep their type because llama.cpp never quantizes them (name, why)."""

    where: str
    type: str
    applied: list[str] = field(default_factory=list)
    kept: list[tuple[str, str]] = field(default_factory=list)

    def line(self) -> str:
        head = f"{self.where}: "
        if not self.applied and not self.kept:
            return head + ("applies to no tensor: its pattern matches none an earlier rule has not taken "
                           "(names look like blk.0.attn_q.weight, blk.0.ffn_up.weight, token_embd.weight)")
        out = head + f"{len(self.applied)} tensor{'s' * (len(self.applied) != 1)} -> {self.type}"
        if self.kept:
            why: dict[str, list[str]] = {}
            for name, w in self.kept:
                why.setdefault(w, []).append(name)
            parts = [f"{w}: {', '.join(ns[:2])}{', ...' if len(ns) > 2 else ''}" for w, ns in why.items()]
            out += (f"; kept: {len(self.kept)} tensor{'s' * (len(self.kept) != 1)} llama.cpp never quantizes "
                    f"({'; '.join(parts)})")
        return out


@dataclass
class BuildPlan:
    recipe: LoadedRecipe
    source_path: Path
    source_blake3: str
    info: ModelInfo
    stages: list[StagePlan]
    excluded: list[str]
    quantization: list[RuleUse] = field(default_factory=list)  # one per rule (and default) that is not keep

    def contract(self, sp: StagePlan) -> StageContract:
        """What stage `sp` takes and gives at its seams, in the recipe's wire dtype. With MTP included, the
        token ids of every position also reach the last stage (its MTP block reads them: docs/deepseek4.md
        section 4, contract item 2), so the seam into it carries the sideband."""
        c = self.info.stage_contract(sp.begin, sp.end, dtype=self.recipe.recipe.boundary.dtype)
        if self.recipe.recipe.bundle.include_mtp:
            last = len(self.stages) - 1
            if sp.index == last and not c.is_first:
                c = c.model_copy(update={"token_ids_in": True})
            elif sp.index == last - 1:
                c = c.model_copy(update={"token_ids_out": True})
        return c


def _owner_ok(owner: int | str, sp: StagePlan, n_stages: int, info: ModelInfo, name: str, mtp: bool) -> bool:
    last = sp.index == n_stages - 1
    if isinstance(owner, int):
        return sp.begin <= owner < sp.end or (mtp and owner >= info.n_layer and last)
    if owner == SHARED:
        return True
    if owner == INPUT:
        if sp.index == 0:
            return True
        copy = info.tied_embeddings or (mtp and mtp_needs_embedding_copy(info))
        return copy and name == "token_embd.weight" and last
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
                          f"(teach dgr.gguf.model.classify about them)")


def _ranges(recipe: LoadedRecipe, info: ModelInfo, w: Weights) -> list[tuple[int, int]]:
    r = recipe.recipe
    if r.placement.stages is not None:
        ranges = list(r.placement.stages)
        try:
            check_ranges(ranges, info.n_layer)
        except ValueError as e:
            raise RecipeError(f"{recipe.path}: placement.stages: {e} (model {info.arch}, {info.n_layer} layers)") from None
        return ranges
    workers = [WorkerSpec(k.name, int(k.memory), k.speed) for k in r.placement.workers or []]
    try:
        return list(plan(w.layer_bytes, workers, **w.kwargs()).ranges)
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
    uses = _rule_uses(recipe)
    for t in info.header.tensors:
        c = choose(t.name, t.type, recipe, t.shape, info.arch)
        check_target(t, c, recipe)
        targets[t.name] = c.type
        _note(uses, c, t.name)
    mtp = r.bundle.include_mtp
    if mtp and not mtp_tensors(info):
        raise RecipeError(f"{recipe.path}: bundle.include_mtp is on, but {info.arch} here has no MTP block (no "
                          f"layer past its {info.n_layer} trunk layers): set include_mtp false")
    w = weights(info, targets, include_mtp=mtp)
    excluded = w.excluded
    ranges = _ranges(recipe, info, w)
    stages = [StagePlan(i, b, e) for i, (b, e) in enumerate(ranges)]
    for t in info.header.tensors:
        if t.name in excluded:
            continue
        owner = info.layer_of[t.name]
        homes = [sp for sp in stages if _owner_ok(owner, sp, len(stages), info, t.name, mtp)]
        if not homes:
            raise BundleError(f"{src}: tensor {t.name!r} (owner {owner}) lands in no stage of {ranges}")
        for sp in homes:
            sp.tensors.append((t, targets[t.name]))
    return BuildPlan(recipe, src, r.source.blake3, info, stages, excluded, list(uses.values()))


def _rule_uses(recipe: LoadedRecipe) -> dict[int | None, RuleUse]:
    """An empty RuleUse per rule that sets a type (and for the default when it does), keyed like Choice.rule."""
    q = recipe.recipe.quantization
    uses: dict[int | None, RuleUse] = {}
    for i, rule in enumerate(q.rules):
        if rule.type != KEEP:
            uses[i] = RuleUse(f"rules[{i}] {rule.pattern}", rule.type)
    if q.default != KEEP:
        uses[None] = RuleUse("default", q.default)
    return uses


def _note(uses: dict[int | None, RuleUse], c: Choice, name: str) -> None:
    use = uses.get(c.rule)
    if use is None or c.asked == KEEP:
        return
    if c.kept:
        use.kept.append((name, c.kept))
    else:
        use.applied.append(name)
