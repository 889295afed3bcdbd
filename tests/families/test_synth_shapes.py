"""`dgr synth --shape`: random-weight models of a real model's shape, written one tensor at a time, deterministic,
loaded and run by the real engine (issue 40 item 2)."""

from __future__ import annotations

import subprocess
import sys

import gguf
import numpy as np
import pytest

from dgr.toolchain.synth.shapes import SHAPES, synth_shape

pytestmark = [pytest.mark.engine]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_a_shape_has_its_real_widths_and_quant_mix_and_runs(name, tmp_path, engine_lib):
    """Two layers of the shape (the full depth is the same tensors repeated): the real widths, Q4_K_M's types, the
    same bytes from the same seed, and the engine generates from it with sane logits."""
    from dgr.app.demo import whole_model_run
    from dgr.runtime.engine import Engine

    s = SHAPES[name]
    a = synth_shape(name, tmp_path / "a.gguf", layers=2)
    assert synth_shape(name, tmp_path / "b.gguf", layers=2).read_bytes() == a.read_bytes()
    assert synth_shape(name, tmp_path / "c.gguf", layers=2, seed=1).read_bytes() != a.read_bytes()
    r = gguf.GGUFReader(a)
    t = {x.name: x for x in r.tensors}
    Q = gguf.GGMLQuantizationType
    assert [int(n) for n in t["token_embd.weight"].shape] == [s.embd, s.vocab]
    assert [int(n) for n in t["blk.1.ffn_down.weight"].shape] == [s.n_ff, s.embd]
    assert [int(n) for n in t["blk.0.attn_k.weight"].shape] == [s.embd, s.n_head_kv * s.embd // s.n_head]
    assert {k: t[k].tensor_type for k in ("blk.0.attn_q.weight", "blk.0.attn_v.weight", "blk.0.ffn_down.weight",
                                          "blk.0.ffn_up.weight", "output.weight", "blk.0.attn_norm.weight")} == {
        "blk.0.attn_q.weight": Q.Q4_K, "blk.0.attn_v.weight": Q.Q6_K, "blk.0.ffn_down.weight": Q.Q6_K,
        "blk.0.ffn_up.weight": Q.Q4_K, "output.weight": Q.Q6_K, "blk.0.attn_norm.weight": Q.F32}
    eng = Engine.open(a, lib=engine_lib, n_threads=1, n_ctx=128)
    try:
        assert eng.describe().n_vocab == s.vocab
        run = whole_model_run(eng, eng.tokenize("The three primary colors are"), 4)
    finally:
        eng.close()
    row = run.logits[0]
    assert np.all(np.isfinite(row)) and 0.1 < float(np.std(row)) < 100, float(np.std(row))


def test_the_command_names_the_shapes_and_refuses_an_unknown_one(tmp_path):
    out = subprocess.run([sys.executable, "-m", "dgr", "synth", "--shape", "gpt-9", "-o", str(tmp_path / "x.gguf")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "unknown --shape 'gpt-9'; shapes: llama-7b, qwen2-7b" in out.stderr
