"""Synthetic models: deterministic, complete, classified, with a tokenizer that round-trips ASCII."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from dgr.cli.main import main
from dgr.gguf.model import INPUT, OUTPUT, model_info
from dgr.toolchain.synth.generic import ARCHS, layer_dims, synth
from dgr.toolchain.synth.spec import WEIGHT
from dgr.toolchain.synth.tokenizer import SPECIALS, byte_symbols, tokenizer_vocab


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_synth_is_deterministic_and_seeded(tmp_path, arch):
    a = synth(arch, 3, 64, 5, tmp_path / "a.gguf")
    b = synth(arch, 3, 64, 5, tmp_path / "b.gguf")
    c = synth(arch, 3, 64, 6, tmp_path / "c.gguf")
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_synth_layers_widths_and_ownership(tmp_path, arch):
    spec = ARCHS[arch]
    layers = max(3, spec.parity_layers)
    p = synth(arch, layers, 64, 1, tmp_path / "m.gguf")
    info = model_info(p)
    assert (info.arch, info.n_layer, info.n_embd, info.n_streams) == (arch, layers, 64, 1)
    assert info.unknown == []
    owners = [info.layer_of[t.name] for t in info.header.tensors]
    assert {o for o in owners if isinstance(o, int)} == set(range(layers))
    assert INPUT in owners and OUTPUT in owners
    # each layer has exactly the tensors its spec says it has (a dense lead, recurrent layers, ...)
    dims = layer_dims(arch, layers, 64)
    for il in range(layers):
        got = sorted(t.name for t in info.header.tensors if info.layer_of[t.name] == il)
        want = sorted(f"{gguf.TENSOR_NAMES[t.tensor].format(bid=il)}{'.' + t.suffix if t.suffix else ''}"
                      for t in spec.layer if t.when is None or t.when(il, dims))
        assert got == want, f"{arch} layer {il}"
    # an independent reader agrees on tensors and the matrices look like small random weights
    r = gguf.GGUFReader(p)
    assert [t.name for t in r.tensors] == [t.name for t in info.header.tensors]
    random = {f"{gguf.TENSOR_NAMES[t.tensor].format(bid=1)}.{t.suffix}" for t in spec.layer
              if t.kind == WEIGHT and t.init is None and (t.when is None or t.when(1, dims))}
    mats = [t for t in r.tensors if t.name in random and t.data.size >= 256]
    assert mats, f"{arch}: no weight matrix in layer 1"
    data = np.asarray(mats[0].data, dtype=np.float32)
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
