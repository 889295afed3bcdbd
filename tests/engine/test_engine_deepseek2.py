"""deepseek2-style MoE (MLA attention, a leading dense block, then MoE layers with shared experts and a
sigmoid router with `exp_probs_b`) split into 2, 3 and 4 stages reproduces the whole model bit for bit
(CPU, f32 boundary), with cuts between the dense layer and the first expert layer and between expert
layers; prompts longer than one ubatch, two sessions in each batch, then greedy decode steps.
Patch 0014 opts deepseek2 in; the byte identity of the patched whole model with the unpatched one is
in test_engine_reference.py."""

from __future__ import annotations

import gguf
import pytest

from dgr.toolchain.parity import Schedule

from support.engine import assert_split_bundle_exact, baseline_and_split, long_prompts, make_bundle, synth_model

pytestmark = pytest.mark.engine

# 6 layers: layer 0 dense (leading_dense_block_count 1), layers 1-5 MoE (4 routed, 2 used, 1 shared)
SPLITS = {
    "2-dense|moe": [(0, 1), (1, 6)],                   # the cut between the dense and first expert layer
    "3-moe|moe": [(0, 2), (2, 3), (3, 6)],             # cuts between expert layers, a one-layer stage
    "4-mixed": [(0, 1), (1, 2), (2, 5), (5, 6)],       # dense|moe, then moe|moe cuts
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return synth_model(tmp_path_factory.mktemp("synth"), "deepseek2")


def test_synthetic_deepseek2_has_a_dense_lead_and_moe_layers(model):
    r = gguf.GGUFReader(str(model))
    assert str(r.fields["general.architecture"].contents()) == "deepseek2"
    assert r.fields["deepseek2.leading_dense_block_count"].contents() == 1
    assert r.fields["deepseek2.expert_gating_func"].contents() == 2  # sigmoid
    names = {t.name for t in r.tensors}
    assert "blk.0.ffn_gate.weight" in names and "blk.0.ffn_gate_inp.weight" not in names
    for il in range(1, 6):
        for t in ("ffn_gate_inp.weight", "exp_probs_b.bias", "ffn_gate_exps.weight", "ffn_up_shexp.weight",
                  "attn_q_a.weight", "attn_kv_a_mqa.weight", "attn_k_b.weight", "attn_v_b.weight"):
            assert f"blk.{il}.{t}" in names
        assert f"blk.{il}.ffn_gate.weight" not in names


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_split_deepseek2_matches_whole_model_exactly(split, model, engine_lib, tmp_path):
    assert_split_bundle_exact(model, SPLITS[split], tmp_path, engine_lib, split)


def test_deepseek2_range_overrides_on_the_whole_gguf_match_too(model, engine_lib):
    sched = Schedule(prompts=long_prompts(256, lengths=(23,)), steps=3, n_ubatch=8)
    _, _, c = baseline_and_split(model, [model] * 3, sched, engine_lib, ranges=[(0, 1), (1, 4), (4, 6)])
    assert c.exact, c


def test_deepseek2_perturbed_boundary_fails_parity(model, engine_lib, tmp_path):
    bundle = make_bundle(model, SPLITS["3-moe|moe"], tmp_path)
    sched = Schedule(prompts=long_prompts(256), steps=2, n_ubatch=16)
    _, _, c = baseline_and_split(model, bundle.stage_paths, sched, engine_lib, perturb=(1, 0, 0, 1e-3))
    assert not c.exact
    assert c.first_diverging == (0, "prefill", 0)


def test_dgr_recipe_build_makes_a_deepseek2_bundle(model, tmp_path):
    from dgr.cli.main import main

    from support.engine import b3

    r = tmp_path / "r" / "recipe.toml"
    r.parent.mkdir()
    r.write_text(f'name = "ds2"\n\n[source]\nuri = "{model}"\nblake3 = "{b3(model)}"\n\n'
                 "[placement]\nstages = [[0, 1], [1, 3], [3, 6]]\n")
    assert main(["recipe", "build", str(r), "--store", str(tmp_path / "store"), "-q"]) == 0
    stages = sorted((tmp_path / "store").rglob("*.gguf"))
    assert len(stages) == 3
    seen = []
    for p in stages:
        names = {t.name for t in gguf.GGUFReader(str(p)).tensors}
        seen.append(sorted({int(n.split(".")[1]) for n in names if n.startswith("blk.")}))
    assert sorted(seen) == [[0], [1, 2], [3, 4, 5]]
