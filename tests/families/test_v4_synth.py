"""The synthetic DeepSeek V4 writer: deterministic bytes, and the inventory the pinned llama.cpp requires.

The requirements checked here are the ones `src/models/deepseek4.cpp` of the pin enforces when it loads
a file (see the module docstring of dgr.toolchain.synth.deepseek4). Loading in llama.cpp itself is exercised by
the engine tests; `test_llama_runs_it` does it here too through llama.cpp's own generation path
(`llama-simple`, built from the engine's CMake tree, or $DGR_LLAMA_BIN's).
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader

from dgr.core.errors import DgrError
from dgr.gguf.model import INPUT, OUTPUT, classify
from dgr.toolchain.synth.deepseek4 import (COMPRESS_RATIOS, CSA_RATIO, GLOBAL_INPUT, GLOBAL_OUTPUT, HCA_RATIO,
                                           INDEXER_KEY_MULTIPLE, make_shape, synth_deepseek4, tensor_inventory)

A = "deepseek4."


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _kv(r: GGUFReader, key: str):
    f = r.fields[key]
    if len(f.types) > 1:  # array
        return [f.parts[i].tolist()[0] for i in f.data]
    v = f.parts[f.data[0]]
    return bytes(v).decode() if f.types[0].name == "STRING" else v.tolist()[0]


def _tensors(r: GGUFReader) -> dict:
    return {t.name: t for t in r.tensors}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return synth_deepseek4(tmp_path_factory.mktemp("v4") / "tiny.gguf", seed=0)


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path, tiny):
    again = synth_deepseek4(tmp_path / "again.gguf", seed=0)
    other = synth_deepseek4(tmp_path / "other.gguf", seed=1)
    assert _sha(again) == _sha(tiny)
    assert _sha(other) != _sha(tiny)
    # a different seed changes weights, not structure
    a, b = _tensors(GGUFReader(tiny)), _tensors(GGUFReader(other))
    assert list(a) == list(b)
    assert not np.array_equal(a["blk.1.attn_q_a.weight"].data, b["blk.1.attn_q_a.weight"].data)
    assert not np.array_equal(a["blk.0.ffn_gate_tid2eid.weight"].data, b["blk.0.ffn_gate_tid2eid.weight"].data)


def test_metadata_llama_requires(tiny):
    r = GGUFReader(tiny)
    assert _kv(r, "general.architecture") == "deepseek4"
    layers, blocks = 4, _kv(r, A + "block_count")
    assert blocks == layers + 1 and _kv(r, A + "nextn_predict_layers") == 1
    assert _kv(r, A + "attention.head_count_kv") == 1
    assert _kv(r, A + "attention.key_length") == _kv(r, A + "attention.value_length")
    assert _kv(r, A + "expert_gating_func") == 4
    assert _kv(r, A + "hyper_connection.count") == 4
    assert _kv(r, A + "embedding_length_out") == 4 * _kv(r, A + "embedding_length")
    assert _kv(r, A + "attention.head_count") % _kv(r, A + "attention.output_group_count") == 0
    assert _kv(r, A + "attention.indexer.key_length") % INDEXER_KEY_MULTIPLE == 0
    assert _kv(r, A + "hash_layer_count") == 3
    ratios = _kv(r, A + "attention.compress_ratios")
    assert r.fields[A + "attention.compress_ratios"].types[1].name == "UINT32"
    assert len(ratios) == blocks and ratios[-1] == 0  # covers MTP, ratio 0 there
    assert set(ratios) == set(COMPRESS_RATIOS)        # the tiny model has every attention kind
    assert set(ratios[:3]) == set(COMPRESS_RATIOS)    # ... inside the hash region too
    for key in ("swiglu_clamp_exp", "swiglu_clamp_shexp"):
        assert len(_kv(r, A + key)) == blocks
    assert _kv(r, "tokenizer.ggml.model") == "gpt2"
    assert len(r.fields["tokenizer.ggml.tokens"].data) == _kv(r, A + "vocab_size")


def test_hash_layers_and_router_bias(tiny):
    r = GGUFReader(tiny)
    t = _tensors(r)
    n_vocab, n_exp, n_used = _kv(r, A + "vocab_size"), _kv(r, A + "expert_count"), _kv(r, A + "expert_used_count")
    n_hash, blocks = _kv(r, A + "hash_layer_count"), _kv(r, A + "block_count")
    for il in range(blocks):
        tid = t.get(f"blk.{il}.ffn_gate_tid2eid.weight")
        bias = t.get(f"blk.{il}.exp_probs_b.bias")
        if il < n_hash:
            assert bias is None and tid is not None
            assert tid.tensor_type == GGMLQuantizationType.I32
            assert list(tid.shape) == [n_used, n_vocab]  # ggml ne order
            table = np.asarray(tid.data).reshape(n_vocab, n_used)
            assert table.min() >= 0 and table.max() < n_exp
            assert all(len(set(row)) == n_used for row in table.tolist())  # distinct experts per token
        else:
            assert tid is None and bias is not None
            assert bias.tensor_type == GGMLQuantizationType.F32 and list(bias.shape) == [n_exp]
        assert list(t[f"blk.{il}.ffn_gate_exps.weight"].shape)[2] == n_exp
        assert f"blk.{il}.ffn_up_shexp.weight" in t


def test_compressor_and_indexer_follow_ratios(tiny):
    r = GGUFReader(tiny)
    t = _tensors(r)
    ratios = _kv(r, A + "attention.compress_ratios")
    D = _kv(r, A + "attention.key_length")
    for il, ratio in enumerate(ratios):
        has_comp = f"blk.{il}.attn_compressor_kv.weight" in t
        has_idx = f"blk.{il}.indexer.attn_q_b.weight" in t
        assert has_comp == (ratio != 0) and has_idx == (ratio == CSA_RATIO)
        if ratio:
            coff = 2 if ratio == CSA_RATIO else 1
            assert list(t[f"blk.{il}.attn_compressor_ape.weight"].shape) == [coff * D, ratio]
    assert HCA_RATIO in ratios


def test_output_projection_reshapes_exactly(tiny):
    r = GGUFReader(tiny)
    H, D = _kv(r, A + "attention.head_count"), _kv(r, A + "attention.key_length")
    G, O = _kv(r, A + "attention.output_group_count"), _kv(r, A + "attention.output_lora_rank")
    wo_a = _tensors(r)["blk.0.attn_output_a.weight"]
    # the loader views it as {H*D/G, O, G}: the element count must agree
    assert int(np.prod(wo_a.shape)) == H * D // G * O * G


def test_mtp_block_is_last_and_optional(tmp_path, tiny):
    t = _tensors(GGUFReader(tiny))
    mtp = [n for n in t if ".nextn." in n]
    assert sorted(mtp) == ["blk.4.nextn.eh_proj.weight", "blk.4.nextn.enorm.weight", "blk.4.nextn.hnorm.weight"]
    assert "blk.4.attn_norm.weight" in t and "blk.4.exp_probs_b.bias" in t  # a full block besides

    no_mtp = GGUFReader(synth_deepseek4(tmp_path / "nomtp.gguf", mtp=False))
    assert _kv(no_mtp, A + "block_count") == 4 and A + "nextn_predict_layers" not in no_mtp.fields
    assert len(_kv(no_mtp, A + "attention.compress_ratios")) == 4
    assert not any(n.startswith("blk.4.") or ".nextn." in n for n in _tensors(no_mtp))


def test_inventory_matches_file(tiny):
    shape = make_shape()
    assert [(n, tuple(reversed(s))) for n, s, _ in tensor_inventory(shape)] == \
        [(t.name, tuple(int(x) for x in t.shape)) for t in GGUFReader(tiny).tensors]


def test_stage_roles_of_global_tensors():
    # what dgr's bundle builder places on the first / last stage agrees with the V4 layout
    names = [n for n, _, _ in tensor_inventory(make_shape()) if not n.startswith("blk.")]
    assert sorted(names) == sorted(GLOBAL_INPUT + GLOBAL_OUTPUT)
    assert all(classify(n) == INPUT for n in GLOBAL_INPUT)
    assert all(classify(n) == OUTPUT for n in GLOBAL_OUTPUT)
    assert classify("blk.4.nextn.eh_proj.weight") == 4 and classify("blk.0.ffn_gate_tid2eid.weight") == 0


def test_f16_matrices(tmp_path):
    t = _tensors(GGUFReader(synth_deepseek4(tmp_path / "h.gguf", dtype="f16")))
    assert t["blk.1.ffn_up_exps.weight"].tensor_type == GGMLQuantizationType.F16
    assert t["blk.1.attn_norm.weight"].tensor_type == GGMLQuantizationType.F32
    assert t["blk.0.ffn_gate_tid2eid.weight"].tensor_type == GGMLQuantizationType.I32


def test_options_change_structure(tmp_path):
    p = synth_deepseek4(tmp_path / "x.gguf", layers=5, embd=64, hash_layers=1, compress_ratios=[128, 0, 4, 4, 0],
                        n_experts=4, n_experts_used=3, seed=7)
    r = GGUFReader(p)
    assert _kv(r, A + "embedding_length") == 64 and _kv(r, A + "expert_count") == 4
    assert _kv(r, A + "attention.compress_ratios") == [128, 0, 4, 4, 0, 0]
    t = _tensors(r)
    assert "blk.0.ffn_gate_tid2eid.weight" in t and "blk.1.exp_probs_b.bias" in t
    assert list(t["blk.0.ffn_gate_tid2eid.weight"].shape)[0] == 3


def test_hash_layers_default_to_three_or_fewer(tmp_path):
    assert make_shape().hash_layers == 3
    r = GGUFReader(synth_deepseek4(tmp_path / "two.gguf", layers=2, compress_ratios=[4, 128]))
    assert _kv(r, A + "hash_layer_count") == 2
    assert {t.name for t in r.tensors if "tid2eid" in t.name} == {"blk.0.ffn_gate_tid2eid.weight",
                                                                   "blk.1.ffn_gate_tid2eid.weight"}


@pytest.mark.parametrize("kw, msg", [
    ({"compress_ratios": [0, 4, 64, 0]}, "compress ratios must be from"),
    ({"compress_ratios": [0, 4]}, "one ratio per main layer"),
    ({"n_head": 6, "o_groups": 4}, "divisible by the output group count"),
    ({"indexer_dim": 96}, "multiple of 64"),
    ({"hash_layers": 5}, "--hash-layers"),
    ({"n_experts_used": 9}, "experts used"),
    ({"head_dim": 64, "indexer_dim": 64}, "must differ"),
])
def test_invalid_shapes_are_refused(tmp_path, kw, msg):
    with pytest.raises(DgrError, match=msg):
        synth_deepseek4(tmp_path / "bad.gguf", **kw)
    assert not (tmp_path / "bad.gguf").exists()


def test_v4_shaped_file(v4shape):
    r = GGUFReader(v4shape)
    assert _kv(r, A + "block_count") == 44 and _kv(r, A + "nextn_predict_layers") == 1
    assert _kv(r, A + "hash_layer_count") == 3 and _kv(r, A + "hyper_connection.count") == 4
    ratios = _kv(r, A + "attention.compress_ratios")
    assert len(ratios) == 44 and ratios[43] == 0
    t = _tensors(r)
    assert [il for il in range(44) if f"blk.{il}.ffn_gate_tid2eid.weight" in t] == [0, 1, 2]
    assert [n for n in t if ".nextn." in n and not n.startswith("blk.43.")] == []


def test_tensor_names_exist_in_pinned_llama_arch(tiny, request):
    # $DGR_LLAMA_SRC, else the pinned tree (fetched and patched on demand; the patches leave
    # llama-arch.cpp as it is, so its names are the pin's)
    env = os.environ.get("DGR_LLAMA_SRC")
    src = Path(env) if env else request.getfixturevalue("llama_src")
    text = (src / "src/llama-arch.cpp").read_text()
    known = set(re.findall(r'"blk\.%d\.([A-Za-z0-9_.]+)"', text)) | set(re.findall(r'"([a-z_]+)"', text))
    for t in GGUFReader(tiny).tensors:
        stem = t.name.rsplit(".", 1)[0]
        m = re.match(r"blk\.\d+\.(.+)$", stem)
        assert (m.group(1) if m else stem) in known, f"{t.name} is not a tensor name of the pinned llama.cpp"


@pytest.fixture(scope="module")
def llama_simple_bin() -> Path:
    from support.llama_simple import llama_simple

    return llama_simple()


def test_llama_runs_it(tiny, llama_simple_bin):
    prompt = "hello world " * 30  # > 128 tokens, so the 128-compressed attention commits a block
    out = subprocess.run([str(llama_simple_bin), "-m", str(tiny), "-n", "8", prompt],
                         capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode(errors="replace")[-2000:]
    assert out.stdout.startswith(prompt.encode())  # the prompt, then up to 8 (random) generated tokens
