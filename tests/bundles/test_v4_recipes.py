"""The DeepSeek V4 Flash recipes (recipes/deepseek4-*.toml): provenance, expert quantization, and placement.

Both recipes name a placeholder source (the real converted GGUF is not on these machines). Here each is
planned against the V4-shaped synthetic file (43 main layers + MTP at tiny width) in place of that
source, and its capacities are checked against the real model's sizes computed from the published
shape of deepseek-ai/DeepSeek-V4-Flash (the `REAL_V4` assumption below, itself checked against the
published 284B total / 13B active parameters; the compress-ratio pattern only moves the small
compressor and indexer tensors).
"""

from __future__ import annotations

import math
from pathlib import Path

import blake3
import gguf
import pytest

from dgr.gguf.model import tensor_nbytes
from dgr.toolchain.bundle import make_plan, target_type
from dgr.toolchain.planner import WorkerSpec, plan
from dgr.toolchain.recipe import LoadedRecipe, Source, load_recipe
from dgr.toolchain.synth.deepseek4 import DeepSeek4Shape, default_ratios, tensor_inventory

from support.paths import REPO

OFFICIAL_REPO = "deepseek-ai/DeepSeek-V4-Flash"
OFFICIAL_REVISION = "60d8d70770c6776ff598c94bb586a859a38244f1"
RECIPES = {"deepseek4-4stage.toml": 4, "deepseek4-12stage.toml": 12}
Q = gguf.GGMLQuantizationType

# V4 Flash's published shape (43 layers, hidden 4096, 64 heads of 512 with rope 64, q-LoRA 1024, 8
# output groups of rank 1024, 256 routed experts of 2048 + 1 shared, 6 active, indexer 64 x 128, window
# 128, vocabulary 129280). Used only for sizes.
REAL_V4 = DeepSeek4Shape(
    layers=43, embd=4096, n_head=64, head_dim=512, rope_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
    n_expert=256, n_expert_used=6, n_expert_shared=1, expert_ff=2048, indexer_heads=64, indexer_dim=128,
    indexer_top_k=512, sliding_window=128, hash_layers=3, compress_ratios=default_ratios(43), mtp=True,
    n_vocab=129280,
)


def _against(recipe: LoadedRecipe, model: Path) -> LoadedRecipe:
    """The same recipe with its source replaced by `model` (same provenance)."""
    src = recipe.recipe.source
    new = Source(uri=str(model), blake3=blake3.blake3(model.read_bytes()).hexdigest(), provenance=src.provenance)
    return LoadedRecipe(recipe=recipe.recipe.model_copy(update={"source": new}), path=recipe.path,
                        text=recipe.text, blake3=recipe.blake3)


@pytest.mark.parametrize("fname", sorted(RECIPES))
def test_recipe_names_the_official_target_and_quantizes_experts(fname):
    lr = load_recipe(REPO / "recipes" / fname)
    r = lr.recipe
    assert r.source.provenance is not None and r.source.provenance.revision == OFFICIAL_REVISION
    assert r.source.provenance.repo == OFFICIAL_REPO
    assert r.bundle.include_mtp is False
    assert r.placement.workers is not None and len(r.placement.workers) == RECIPES[fname]
    for proj in ("gate", "up", "down"):
        assert target_type(f"blk.7.ffn_{proj}_exps.weight", Q.BF16, lr) == Q.Q4_0
    # tables and mixers that must stay exact keep their type
    for name in ("blk.0.ffn_gate_tid2eid.weight", "blk.5.exp_probs_b.bias", "blk.5.hc_attn_fn.weight",
                 "blk.5.attn_sinks.weight", "blk.5.attn_norm.weight", "output_hc_fn.weight"):
        assert target_type(name, Q.F32, lr) == Q.F32, name


@pytest.mark.parametrize("fname", sorted(RECIPES))
def test_recipe_plans_against_v4_shaped_file(fname, v4shape):
    lr = _against(load_recipe(REPO / "recipes" / fname), v4shape)
    bp = make_plan(lr)
    ranges = [(s.begin, s.end) for s in bp.stages]
    assert len(ranges) == RECIPES[fname]
    assert ranges[0][0] == 0 and ranges[-1][1] == 43
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    # the scenario recipes leave MTP out (bundle.include_mtp off): block 43 is excluded from every stage
    assert bp.excluded and all(n.startswith("blk.43.") for n in bp.excluded)
    assert not any(t.name.startswith("blk.43.") for s in bp.stages for t, _ in s.tensors)
    # the embedding on the first stage, the hyper-connection head + norm + LM head on the last only
    names = [{t.name for t, _ in s.tensors} for s in bp.stages]
    assert "token_embd.weight" in names[0] and not any("token_embd.weight" in n for n in names[1:])
    for head in ("output_hc_fn.weight", "output_norm.weight", "output.weight"):
        assert head in names[-1] and not any(head in n for n in names[:-1])
    # experts are planned at Q4_0, hash tables as they are
    types = {t.name: q for s in bp.stages for t, q in s.tensors}
    assert types["blk.10.ffn_down_exps.weight"] == Q.Q4_0
    assert types["blk.0.ffn_gate_tid2eid.weight"] == Q.I32
    assert bp.info.n_streams == 4 and bp.info.n_hash_layers == 3
    for s, w in zip(bp.stages, lr.recipe.placement.workers):
        assert s.weight_bytes <= w.memory


@pytest.mark.parametrize("fname", sorted(RECIPES))
def test_recipe_capacities_hold_the_real_model(fname):
    lr = load_recipe(REPO / "recipes" / fname)
    layer_bytes = [0] * REAL_V4.layers
    first = last = 0
    kinds = {"tid2eid": Q.I32}
    for name, shape, kind in tensor_inventory(REAL_V4):
        src = kinds.get(kind, Q.BF16 if kind == "w" else Q.F32)
        nb = tensor_nbytes(tuple(reversed(shape)), target_type(name, src, lr))
        if name.startswith("blk."):
            il = int(name.split(".")[1])
            if il < REAL_V4.layers:  # MTP excluded
                layer_bytes[il] += nb
        elif name.startswith("token_embd"):
            first += nb
        else:
            last += nb
    workers = [WorkerSpec(w.name, w.memory, w.speed) for w in lr.recipe.placement.workers]
    p = plan(layer_bytes, workers, input_bytes=first, output_bytes=last)
    assert len(p.ranges) == RECIPES[fname]
    assert all(b <= w.memory for b, w in zip(p.stage_bytes, workers))
    # the routed experts are most of the model: at Q4_0 (4.5 bits) + Q8_0 the whole thing is ~164 GB,
    # as the recipes' header comments say
    assert 160e9 < sum(p.stage_bytes) < 168e9


def _params(s: DeepSeek4Shape) -> dict[str, int]:
    """Parameter counts of the main model (no MTP block): routed experts, the rest, the input embedding."""
    out = {"experts": 0, "rest": 0, "embedding": 0}
    for name, shape, _ in tensor_inventory(s):
        if name.startswith(f"blk.{s.layers}."):
            continue  # the MTP block
        n = math.prod(shape)
        out["experts" if "_exps." in name else "rest"] += n
        if name == "token_embd.weight":
            out["embedding"] += n
    return out


def test_real_shape_is_the_published_v4_flash():
    """REAL_V4 (which sizes the recipes) has V4 Flash's published parameter counts, and its published
    FP4-expert / FP8-rest weights come to ~154 GB (the recipes' header comments)."""
    p = _params(REAL_V4)
    total = p["experts"] + p["rest"]
    assert abs(total - 284e9) < 0.01 * 284e9, total
    # active per token: 6 of 256 routed experts, everything else but the embedding lookup
    active = p["experts"] * REAL_V4.n_expert_used / REAL_V4.n_expert + p["rest"] - p["embedding"]
    assert abs(active - 13e9) < 0.05 * 13e9, active
    published = p["experts"] * 4.25 / 8 + p["rest"] * 1.0  # FP4 with a scale per 32 values; FP8
    assert 150e9 < published < 160e9, published
