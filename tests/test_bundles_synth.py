"""Synthetic models: deterministic, complete, classified, with a tokenizer that round-trips ASCII."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from dgr.cli import main
from dgr.ggufmodel import INPUT, OUTPUT, model_info
from dgr.synth import ARCHS, SPECIALS, byte_symbols, synth, tokenizer_vocab


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_synth_is_deterministic_and_seeded(tmp_path, arch):
    a = synth(arch, 3, 64, 5, tmp_path / "a.gguf")
    b = synth(arch, 3, 64, 5, tmp_path / "b.gguf")
    c = synth(arch, 3, 64, 6, tmp_path / "c.gguf")
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_synth_layers_widths_and_ownership(tmp_path, arch):
    p = synth(arch, 3, 64, 1, tmp_path / "m.gguf")
    info = model_info(p)
    assert (info.arch, info.n_layer, info.n_embd, info.n_streams) == (arch, 3, 64, 1)
    assert info.unknown == []
    owners = [info.layer_of[t.name] for t in info.header.tensors]
    assert {o for o in owners if isinstance(o, int)} == {0, 1, 2}
    assert INPUT in owners and OUTPUT in owners
    # every layer has the same tensor set (deepseek2: every layer after its leading dense one)
    per_layer = [sorted(t.name.split(".", 2)[2] for t in info.header.tensors if info.layer_of[t.name] == i)
                 for i in range(3)]
    lead = 1 if arch == "deepseek2" else 0
    assert per_layer[lead:] == [per_layer[2]] * (3 - lead) and per_layer[0] != (per_layer[1] if lead else [])
    # an independent reader agrees on tensors and values look like small random weights
    r = gguf.GGUFReader(p)
    assert [t.name for t in r.tensors] == [t.name for t in info.header.tensors]
    q = next(t for t in r.tensors if t.name in ("blk.1.attn_q.weight", "blk.1.attn_q_a.weight"))
    data = np.asarray(q.data, dtype=np.float32)
    assert 0.01 < float(data.std()) < 0.04
    assert arch + ".block_count" in r.fields


def test_synth_arch_specifics(tmp_path):
    g = model_info(synth("gemma3", 4, 64, 0, tmp_path / "g.gguf"))
    assert g.tied_embeddings and g.header.get("gemma3.attention.sliding_window") == 8
    assert g.header.get("gemma3.attention.sliding_window_pattern") == 2
    m = model_info(synth("qwen3moe", 2, 64, 0, tmp_path / "m.gguf"))
    assert m.header.get("qwen3moe.expert_count") == 4 and m.header.get("qwen3moe.expert_used_count") == 2
    assert m.header.tensor("blk.0.ffn_up_exps.weight").shape == (64, 64, 4)
    q2 = model_info(synth("qwen2", 2, 64, 0, tmp_path / "q.gguf"))
    assert "blk.1.attn_q.bias" in q2.layer_of
    assert not model_info(synth("llama", 2, 64, 0, tmp_path / "l.gguf")).tied_embeddings
    assert model_info(synth("llama", 2, 64, 0, tmp_path / "t.gguf", tied=True)).tied_embeddings


def test_tokenizer_is_byte_level_and_round_trips_ascii():
    sym = byte_symbols()
    assert len(set(sym)) == 256
    tokens, types, merges = tokenizer_vocab()
    assert len(tokens) == len(set(tokens)) == len(types)
    assert tokens[-len(SPECIALS):] == list(SPECIALS)
    for m in merges:  # every merge's result is a token
        a, b = m.split(" ")
        assert a + b in tokens and a in tokens and b in tokens
    text = "Hello, world! 0123 ~{}\n\t"
    encoded = [tokens.index(sym[b]) for b in text.encode()]
    inverse = {s: i for i, s in enumerate(sym)}
    assert bytes(inverse[tokens[i]] for i in encoded).decode() == text


def test_synth_cli_and_errors(tmp_path, capsys):
    out = tmp_path / "x.gguf"
    assert main(["synth", "--arch", "qwen3", "--layers", "2", "--embd", "32", "--seed", "9", "-o", str(out)]) == 0
    assert model_info(out).n_layer == 2
    assert main(["synth", "--arch", "nope", "--layers", "2", "-o", str(out)]) != 0
    assert "unknown --arch 'nope'" in capsys.readouterr().err
    assert main(["synth", "--arch", "llama", "--embd", "40", "-o", str(out)]) != 0
    assert "multiple of 16" in capsys.readouterr().err
