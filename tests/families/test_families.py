"""Every architecture `dgr synth --list` names: a fresh tiny model, split across its special layers into
2, 3 and 4 stages (dgr.toolchain.synth.parity's cuts), equals the whole model bit for bit (prefill and decode, two
sessions sharing each batch); docs/families.md says the same as this suite."""

from __future__ import annotations

import pytest

from dgr.cli.main import main
from dgr.toolchain.synth.generic import known_archs
from dgr.toolchain.synth.parity import STAGE_COUNTS, choose_ranges, features, model_layers, read_table, run_synth_parity

ARCHS = known_archs()


@pytest.mark.engine
@pytest.mark.parametrize("stages", STAGE_COUNTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_split_equals_whole_model_exactly(arch, stages, engine_lib, tmp_path):
    r = run_synth_parity(arch, stages, tmp_path, lib=engine_lib)
    assert r.n_values > 0
    assert r.exact, r.line()
    assert r.greedy_agree


# what only a stage that keeps one running state per session (or none per position) cannot do
ONE_STATE = {a for a in ARCHS if {"recurrent", "hybrid"} & set(features(a))} | {"deepseek4"}
ROLLS_BACK_ITS_LAST_STEP = {"bailingmoe3", "deepseek4", "lfm2", "lfm2moe", "nemotron_h", "nemotron_h_moe", "qwen35",
                            "qwen35moe"}      # hybrids whose cache keeps per-step snapshots (n_rs_seq)


@pytest.mark.engine
@pytest.mark.parametrize("arch", ARCHS)
def test_a_kept_prefix_and_a_rollback_equal_the_cold_whole_model_or_are_refused_by_name(arch, engine_lib, tmp_path,
                                                                                       repo_root):
    """The engine calls of the prefix cache (restore whole and cut back) and of speculation's rollback on every
    family, 3 stages: exact, or refused by name; docs/families.md's columns say the same."""
    from dgr.toolchain.synth.features import run_features

    rs = run_features(arch, tmp_path, lib=engine_lib)
    row = read_table(repo_root / "docs" / "families.md")[arch]
    for name, r in rs.items():
        assert r.exact or r.refused, f"{name}: {r.verdict}"
        assert row[name.replace(" ", "_")] == r.verdict, name
    assert rs["prefix cache"].refused == (arch in ONE_STATE), rs["prefix cache"].verdict   # sliding windows are exact
    expect_refused = arch in ONE_STATE and arch not in ROLLS_BACK_ITS_LAST_STEP
    assert rs["rollback"].refused == expect_refused, rs["rollback"].verdict


@pytest.mark.engine
@pytest.mark.parametrize("arch", ARCHS)
def test_the_feature_matrix_holds_on_the_invariant_kernels(arch, engine_lib, tmp_path, repo_root):
    """The same engine calls on kernels="invariant" (the fast invariant set: the tiled attention for every number
    of queries, repacked Q4_K and tiled Q6_K with one-row paths of their order; docs/batching.md), the baseline
    and every stage on it: docs/families.md's verdicts, exact or refused by name, as on the reference kernels."""
    from dgr.toolchain.synth.features import run_features

    rs = run_features(arch, tmp_path, lib=engine_lib, kernels="invariant")
    row = read_table(repo_root / "docs" / "families.md")[arch]
    for name, r in rs.items():
        assert r.exact or r.refused, f"{name} (invariant kernels): {r.verdict}"
        assert row[name.replace(" ", "_")] == r.verdict, f"{name} (invariant kernels)"


def test_synth_list_names_every_architecture(capsys):
    assert main(["synth", "--list"]) == 0
    listed = capsys.readouterr().out.split()
    assert listed == ARCHS
    assert len(set(listed)) == len(listed)


def test_parity_synth_cli_exits_0_on_exact_and_names_unknown_architectures(engine_lib, capsys):
    assert main(["parity", "--synth", "llama", "--stages", "3", "--lib", str(engine_lib)]) == 0
    out = capsys.readouterr().out
    assert "llama: 3 stages [0,2) [2,4) [4,6)" in out and "EXACT" in out
    assert main(["parity", "--synth", "no-such-arch", "--stages", "3"]) != 0
    assert "unknown architecture 'no-such-arch'" in capsys.readouterr().err


def test_cuts_cross_the_special_layers():
    # the cuts fall where the layer kind changes (SWA/global, dense/MoE, attention/recurrent) first
    assert choose_ranges(["dense", "moe", "moe", "moe", "moe", "moe"], 3) == [(0, 1), (1, 4), (4, 6)]
    assert choose_ranges(["attn", "attn", "attn", "rec", "rec", "rec", "rec", "attn"], 3) == [(0, 3), (3, 7), (7, 8)]
    assert choose_ranges(["layer"] * 6, 4) == [(0, 2), (2, 3), (3, 4), (4, 6)]
    with pytest.raises(Exception, match="splits into 1..6 stages"):
        choose_ranges(["layer"] * 6, 7)


def test_docs_table_and_suite_agree(repo_root):
    """docs/families.md (written by `dgr parity --synth all --stages 2,3,4 --table ...`) has one row per
    architecture of the suite, with its features, the stage counts the suite tries, the 3-stage cuts it
    takes and an exact result; regenerate the table when this fails."""
    from dgr.toolchain.synth.generic import layer_kinds

    table = read_table(repo_root / "docs" / "families.md")
    assert sorted(table) == ARCHS, "docs/families.md lists other architectures than `dgr synth --list`"
    for arch, row in table.items():
        assert row["features"] == (", ".join(features(arch)) or "-"), arch
        assert row["stages"] == ", ".join(map(str, STAGE_COUNTS)), arch
        cuts = choose_ranges(layer_kinds(arch, model_layers(arch)), 3)
        assert row["cuts"] == " ".join(f"[{a},{b})" for a, b in cuts), arch
        assert row["result"] == "exact", arch
        for column in ("prefix_cache", "rollback"):
            assert row[column] == "exact" or row[column].startswith("refused: "), (arch, column)
