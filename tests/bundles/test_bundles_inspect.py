"""`dgr inspect`: layers, widths, the boundary a split carries, bytes, tied embeddings, unknown tensors, the chat
template and the special tokens (bos, eos, eot and every end-of-generation id, as llama.cpp sees them)."""

from __future__ import annotations

import json
import re

import gguf
import numpy as np
import pytest

from dgr.cli.main import main
from dgr.gguf.model import model_info


def test_inspect_smollm2(smollm2_gguf, capsys):
    assert main(["inspect", str(smollm2_gguf), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["arch"], r["n_layer"], r["n_embd"], r["n_streams"]) == ("llama", 30, 576, 1)
    assert r["boundary_shape"] == [1, 576] and r["boundary_bytes_per_token"]["f32"] == 576 * 4
    assert r["tied_embeddings"] is True and r["unknown_tensors"] == []
    total = r["input_bytes"] + sum(r["layer_bytes"]) + r["output_bytes"] - r["input_bytes"]  # tied: counted twice
    assert total == r["total_tensor_bytes"] and len(set(r["layer_bytes"])) == 1
    assert main(["inspect", str(smollm2_gguf)]) == 0
    text = capsys.readouterr().out
    assert "layers:          30" in text and "tied embeddings: yes" in text and "unknown tensors: none" in text


def test_inspect_deepseek4_mhc_boundary(tmp_path, capsys):
    out = tmp_path / "v4.gguf"
    assert main(["synth", "--arch", "deepseek4", "--layers", "4", "--embd", "128", "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["arch"] == "deepseek4" and r["n_layer"] == 4 and r["n_layer_mtp"] == 1
    assert r["boundary_shape"] == [4, 128] and r["boundary_bytes_per_token"]["bf16"] == 4 * 128 * 2
    assert r["n_hash_layers"] == 3 and r["unknown_tensors"] == []
    # synth's V4 defaults: 8 routed + 1 shared experts, 2 active, every main layer MoE
    assert r["experts"] == {"routed": 8, "shared": 1, "active": 2, "moe_layers": 4}
    info = model_info(out)
    assert info.needs_token_ids(1) and info.needs_token_ids(2) and not info.needs_token_ids(3)


def test_inspect_dense_model_has_no_experts(tmp_path, capsys):
    out = tmp_path / "llama.gguf"
    assert main(["synth", "--arch", "llama", "--layers", "2", "--embd", "32", "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["experts"] is None


def test_inspect_reports_unknown_tensors(tmp_path, capsys):
    p = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_block_count(1)
    w.add_embedding_length(8)
    for name in ("token_embd.weight", "blk.0.attn_norm.weight", "mystery_table.weight"):
        w.add_tensor(name, np.zeros((8,), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert main(["inspect", str(p)]) == 0
    assert "UNKNOWN tensors" in capsys.readouterr().out and "mystery_table.weight" in model_info(p).unknown
    assert main(["inspect", str(tmp_path / "missing.gguf")]) != 0
    assert "cannot open" in capsys.readouterr().err


def test_inspect_a_bundle_stage(tmp_path, capsys):
    from dgr.core.hashing import file_blake3
    from dgr.toolchain.bundle import build
    from dgr.toolchain.synth.generic import synth

    model = synth("llama", 4, 32, 0, tmp_path / "m.gguf", tied=True)
    r = tmp_path / "r.toml"
    r.write_text(f'name = "st"\n[source]\nuri = "m.gguf"\nblake3 = "{file_blake3(model)}"\n'
                 '[placement]\nstages = [[0, 1], [1, 3], [3, 4]]\n[boundary]\ndtype = "bf16"\n')
    b = build(r, tmp_path / "store")
    reports = []
    for p in b.stage_paths:
        assert main(["inspect", str(p), "--json"]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    assert [(x["stage"]["layer_begin"], x["stage"]["layer_end"]) for x in reports] == [(0, 1), (1, 3), (3, 4)]
    assert [x["tied_embeddings"] for x in reports] == [False, False, True]
    assert all(x["stage"]["boundary_dtype"] == "bf16" and x["n_layer"] == 4 for x in reports)
    assert [sum(1 for v in x["layer_bytes"] if v) for x in reports] == [1, 2, 1]
    assert main(["inspect", str(b.stage_paths[1])]) == 0
    assert "bundle stage:    1 of 3 (recipe st), owns layers [1, 3)" in capsys.readouterr().out


@pytest.mark.engine
def test_inspect_shows_the_chat_template_and_the_special_tokens(smollm2_gguf, engine_lib, capsys):
    assert main(["inspect", str(smollm2_gguf), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    ct, st = r["chat_template"], r["special_tokens"]
    assert ct["present"] and ct["chars"] > 100 and ct["first_line"].startswith("{% for message in messages %}")
    assert st["from"] == "llama.cpp"
    assert st["bos"] == {"id": 1, "text": "<|im_start|>"} and st["eos"] == {"id": 2, "text": "<|im_end|>"}
    assert {"id": 0, "text": "<|endoftext|>"} in st["eog"] and st["eos"] in st["eog"]
    assert main(["inspect", str(smollm2_gguf)]) == 0
    text = capsys.readouterr().out
    assert "chat template:   yes" in text and "{% for message in messages %}" in text
    assert "bos 1 '<|im_start|>', eos 2 '<|im_end|>'" in text
    assert re.search(r"end of generation \(\d+, llama.cpp's list.*0 '<\|endoftext\|>', 2 '<\|im_end\|>'", text), text


@pytest.mark.engine
def test_inspect_names_an_end_of_turn_that_is_not_the_eos(engine_lib, tmp_path, capsys, monkeypatch):
    from dgr.toolchain.synth.generic import synth
    from dgr.toolchain.synth.tokenizer import tokenizer_vocab

    from support.engine import rewrite_gguf

    model = rewrite_gguf(synth("llama", 2, 32, 0, tmp_path / "m.gguf"), tmp_path / "eot.gguf",
                         set_kv={gguf.Keys.Tokenizer.EOT_ID: 65})
    assert main(["inspect", str(model), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)["special_tokens"]
    eot = {"id": 65, "text": tokenizer_vocab()[0][65]}
    assert st["eot"] == eot and eot in st["eog"] and st["eos"] in st["eog"] and st["eos"] != eot
    assert main(["inspect", str(model)]) == 0
    text = capsys.readouterr().out
    assert "chat template:   none" in text and "--chat-template FILE" in text
    assert f"eot 65 {eot['text']!r}" in text
    # without an engine library: what the header declares, and why the rest is missing
    monkeypatch.setenv("DGR_ENGINE_LIB", str(tmp_path / "no-engine.so"))
    assert main(["inspect", str(model), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)["special_tokens"]
    assert st["from"] == "header" and st["eog"] is None and "no-engine.so" in st["note"]
    assert st["eot"] == eot
    assert main(["inspect", str(model)]) == 0
    assert "end of generation: unknown (llama.cpp's view needs the engine" in capsys.readouterr().out
