"""SmolLM2-135M-Instruct (llama, 30 layers, tied embeddings, Q4_1): real weights split into real
bundles reproduce the whole model exactly; the stages load only their tensors and hold KV only for
their layers."""

from __future__ import annotations

import pytest

from dgr.runtime.engine import Engine
from dgr.toolchain.parity import Schedule

from support.engine import alone_and_shared, baseline_and_split, make_bundle

pytestmark = pytest.mark.engine

PROMPT = "<|im_start|>user\nWhat is the capital of France? Answer in one word.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def prompt_ids(smollm2_gguf, engine_lib):
    with Engine.open(smollm2_gguf, n_ctx=128, max_sessions=1, lib=engine_lib) as e:
        ids = e.tokenize(PROMPT)
        assert e.detokenize(ids) == PROMPT
    return ids


@pytest.mark.slow
@pytest.mark.parametrize("ranges", [
    [(0, 15), (15, 30)],
    [(0, 1), (1, 20), (20, 30)],                  # a one-layer first stage
    [(0, 7), (7, 8), (8, 29), (29, 30)],          # one-layer middle and last stages
], ids=["2", "3", "4"])
def test_smollm2_bundle_parity_is_exact(ranges, smollm2_gguf, prompt_ids, engine_lib, tmp_path):
    bundle = make_bundle(smollm2_gguf, ranges, tmp_path, name="smol")
    sched = Schedule(prompts=[prompt_ids, prompt_ids[:17]], steps=6, n_ubatch=16)
    base, run, c = baseline_and_split(smollm2_gguf, bundle.stage_paths, sched, engine_lib)
    assert c.exact, f"max abs {c.max_abs_diff}, first diverging {c.first_diverging}"
    assert run.generated == base.generated
    # the whole model answers sensibly: the prompt is real, so is the model
    with Engine.open(smollm2_gguf, n_ctx=64, max_sessions=1, lib=engine_lib) as e:
        assert "Paris" in e.detokenize(base.generated[0])


def test_stage_memory_is_its_share_of_the_whole(smollm2_gguf, engine_lib, tmp_path):
    bundle = make_bundle(smollm2_gguf, [(0, 10), (10, 16), (16, 30)], tmp_path, name="smol")
    n_ctx = 256
    with Engine.open(smollm2_gguf, n_ctx=n_ctx, max_sessions=2, lib=engine_lib) as whole:
        w = whole.memory()
    assert w.kv_bytes > 0 and w.weights_bytes > 0
    per_layer = w.kv_bytes // 30
    assert per_layer * 30 == w.kv_bytes
    total_weights = 0
    for i, path in enumerate(bundle.stage_paths):
        s = bundle.manifest.stages[i]
        with Engine.open(path, n_ctx=n_ctx, max_sessions=2, lib=engine_lib) as e:
            m = e.memory()
            info = e.describe()
        assert (info.layer_begin, info.layer_end) == (s.layer_begin, s.layer_end)
        # KV only for the owned layers, exactly
        assert m.kv_bytes == per_layer * (s.layer_end - s.layer_begin)
        assert m.layers_with_state == tuple(range(s.layer_begin, s.layer_end))
        # weights: what the stage file holds (the manifest's count), no more
        assert s.weight_bytes <= m.weights_bytes <= s.weight_bytes + 64 * 1024
        total_weights += m.weights_bytes
    # the tied embedding is held twice (input on stage 0, head on the last stage), nothing else
    assert total_weights > w.weights_bytes


def test_range_override_loads_only_owned_tensors_of_a_whole_file(smollm2_gguf, engine_lib):
    with Engine.open(smollm2_gguf, n_ctx=64, max_sessions=1, lib=engine_lib) as whole:
        w = whole.memory()
    with Engine.open(smollm2_gguf, layer_range=(10, 13), n_ctx=64, max_sessions=1, lib=engine_lib) as mid:
        m = mid.memory()
        info = mid.describe()
    assert not info.is_first and not info.is_last
    assert m.kv_bytes * 10 == w.kv_bytes
    # 3 of 30 layers and no embedding/head: well under a tenth of the whole file's weights
    assert 0 < m.weights_bytes < w.weights_bytes / 10


def test_smollm2_session_is_bit_identical_alone_or_sharing_batches(smollm2_gguf, engine_lib):
    """With SmolLM2's Q4_1 weights (quantized dot products, per row), a session computes the same bits
    whether or not another session shares its batches: concurrent sessions are exact here."""
    with Engine.open(smollm2_gguf, n_ctx=64, max_sessions=1, lib=engine_lib) as e:
        a = e.tokenize("The capital of France is")
        b = e.tokenize("Once upon a time, there was a little dragon who lived in")
    alone, shared = alone_and_shared(smollm2_gguf, engine_lib, a, b, steps=5)
    for i, (x, y) in enumerate(zip(alone, shared)):
        assert x.tobytes() == y.tobytes(), f"forward {i} differs"
