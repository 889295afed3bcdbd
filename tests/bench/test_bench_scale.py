"""`dgr bench scale`: one model split into several stage counts in one run. The report has a row per stage
count asked for, the same greedy tokens for every count (exit 1 when they differ), an RSS and the weight
bytes for every stage, stage layer shares that add up to the model's layer bytes, and the boundary per hop
computed from the wire dtype table. Nothing here compares a time: `dgr bench scale` measures speed."""

from __future__ import annotations

import pytest

from dgr.app.bench import scale

from support.bench_cli import run_bench_json


def _scale(tmp_path, *argv) -> tuple[int, dict]:
    return run_bench_json(tmp_path, "scale", *argv)


@pytest.mark.engine
def test_scale_on_a_tiny_model_reports_every_stage_count_with_the_same_tokens(tmp_path, capsys, engine_lib):
    pytest.importorskip("matplotlib")
    png = tmp_path / "scale.png"
    rc, rep = _scale(tmp_path, "--synth", "llama", "--stages", "1,2", "--tokens", "4", "--plot", str(png))
    assert rc == 0 and rep["same_tokens"] is True
    runs = rep["runs"]
    assert [r["stages"] for r in runs] == [1, 2]
    assert runs[0]["token_ids"] == runs[1]["token_ids"] and len(runs[0]["token_ids"]) == 4
    layer_total = rep["bench"]["model_layer_bytes"]
    assert layer_total > 0
    for r in runs:
        st = r["per_stage"]
        assert [s["stage"] for s in st] == list(range(r["stages"]))
        # the ranges tile the model's layers, half-open, in order; their layer bytes add up to the model's
        assert st[0]["layers"][0] == 0 and st[-1]["layers"][1] == rep["bench"]["n_layer"]
        assert all(a["layers"][1] == b["layers"][0] for a, b in zip(st, st[1:]))
        assert sum(s["layer_bytes"] for s in st) == layer_total
        assert all(s["rss_bytes"] > 0 and s["hwm_bytes"] >= s["rss_bytes"] for s in st)
        assert all(s["weight_bytes"] >= s["layer_bytes"] > 0 for s in st)
        assert all(s["rss_minus_weights_bytes"] == s["rss_bytes"] - s["weight_bytes"] for s in st)
        assert r["max_rss_bytes"] == max(s["rss_bytes"] for s in st)
        # each stage's KV as its engine allocated it (the descriptor's memory report), and RSS against weights + KV
        assert all(s["kv_bytes"] > 0 for s in st)
        assert all(s["rss_over_weights_and_kv"] == pytest.approx(s["rss_bytes"] / (s["weight_bytes"] + s["kv_bytes"]), abs=1e-4)
                   for s in st)
        assert r["max_rss_over_weights_and_kv"] == max(s["rss_over_weights_and_kv"] for s in st)
        assert r["total_weight_bytes"] == sum(s["weight_bytes"] for s in st)
        assert r["tpot_ms"] > 0 and r["per_hop_ms"] > 0 and r["floor_one_way_ms"] > 0
        assert r["decode_tokens_timed"] == 3                        # every decode token after the first
    assert runs[0]["slope_ms_per_stage"] == 0
    # one stage holds every tensor of the model (no MTP layers, untied embeddings: nothing left out or copied)
    assert runs[0]["total_weight_bytes"] == rep["bench"]["model_weight_bytes"]
    assert runs[1]["model_weights_over_s_bytes"] == rep["bench"]["model_weight_bytes"] / 2
    bb = rep["boundary_bytes_per_token_per_hop"]
    assert bb["computed"] is True and bb["this_model"]["values"] == rep["bench"]["n_embd"]
    assert bb["this_model"]["f32"] == 4 * rep["bench"]["n_embd"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "greedy tokens the same for every stage count: yes" in out and "DeepSeek V4" in out


def test_the_deepseek_v4_boundary_is_64_kib_in_f32_per_token():
    b = scale.boundary_bytes(scale.V4_STREAMS * scale.V4_EMBD)
    assert b["f32"] == 64 * 1024
    assert b["q8_0"] == 4 * 4096 // 32 * 34                         # an f16 scale and 32 int8 per block


def test_tokens_that_differ_between_stage_counts_fail_the_command(tmp_path, monkeypatch, capsys):
    def fake_run(**kw):
        row = {"stages": 1, "tpot_ms": 1.0, "slope_ms_per_stage": 0.0, "per_hop_ms": 0.1, "floor_one_way_ms": 0.05,
               "per_hop_over_floor": 2.0, "model_weights_over_s_bytes": 10, "compute_ms": 0.8,
               "max_rss_bytes": 10, "max_weight_bytes": 5,
               "per_stage": [{"stage": 0, "layers": [0, 2], "rss_bytes": 10, "weight_bytes": 5,
                              "rss_minus_weights_bytes": 5}]}
        bb = {"values": 64, "f32": 256}
        return {"bench": {"model": "m", "arch": "llama", "n_layer": 2, "n_embd": 64, "threads": 1, "tokens": 4,
                          "cpus": 2, "seconds": 0.1},
                "runs": [row], "tpot_slope_ms_per_stage": 0.0, "same_tokens": False,
                "boundary_bytes_per_token_per_hop": {"this_model": bb, "deepseek_v4": bb}}

    monkeypatch.setattr(scale, "run_scale", fake_run)
    rc, rep = _scale(tmp_path, "--synth", "llama", "--stages", "1,2")
    assert rc == 1 and rep["same_tokens"] is False
    assert "greedy tokens the same for every stage count: NO" in capsys.readouterr().out


def test_a_stage_list_that_is_not_numbers_is_refused(tmp_path):
    with pytest.raises(Exception, match="stage counts separated by commas"):
        _scale(tmp_path, "--synth", "llama", "--stages", "one,two")


@pytest.mark.engine
def test_the_long_context_lane_prefills_one_prompt_whole_and_on_four_stages_with_the_same_logits(tmp_path, capsys,
                                                                                               engine_lib):
    rc, rep = _scale(tmp_path, "--synth", "llama", "--stages", "1", "--tokens", "2", "--long-context", "700",
                     "--chunk-tokens", "128")
    assert rc == 0
    lc = rep["long_context"]
    assert lc["prompt_tokens"] == 700 and lc["stages"] == 4 and lc["chunk_tokens"] == 128
    whole, split = lc["whole"], lc["split"]
    assert whole["stages"] == 1 and split["stages"] == 4
    assert whole["chunk_tokens"] == split["chunk_tokens"] == 128
    # the prompt's last position and every generated token after it, in both, equal bit for bit
    assert lc["rows_compared"] == whole["logits_rows"] == split["logits_rows"]
    assert lc["rows_compared"][0] == 699 and len(lc["rows_compared"]) == lc["tokens"] == scale.LONG_TOKENS
    assert lc["logits_exact"] is True and lc["logits_max_abs_diff"] == 0 and lc["same_tokens"] is True
    assert whole["ttft_s"] > 0 and split["ttft_s"] > 0
    # the report rounds (dgr.app.bench.pipeline.rounded): the ratio is of the unrounded times
    assert lc["ttft_ratio"] == pytest.approx(split["ttft_s"] / whole["ttft_s"], rel=0.05)
    st = split["per_stage"]
    assert [s["layers"][0] for s in st][0] == 0 and st[-1]["layers"][1] == rep["bench"]["n_layer"]
    # each stage holds KV for its own layers only: the split's KV adds up to the whole model's
    assert sum(s["kv_bytes"] for s in st) == whole["per_stage"][0]["kv_bytes"]
    assert all(s["rss_bytes"] > 0 and s["weight_bytes"] > 0 for s in st)
    assert "left_out" not in rep
    out = capsys.readouterr().out
    assert "long context: a 700-token prompt" in out and "the same bit for bit: yes" in out


def test_a_long_context_beyond_what_the_model_was_trained_for_is_refused(tmp_path):
    with pytest.raises(Exception, match="trained for 8192 positions"):
        _scale(tmp_path, "--stages", "1", "--long-context", "32768")
