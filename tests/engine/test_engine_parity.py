"""Exact parity: a split run of a bundle reproduces the whole model bit for bit (CPU, f32 boundary).

Every architecture dgr claims: tiny random-weight models (dgr synth) split into 2, 3 and 4 stages
(uneven splits, a one-layer stage, cuts on each side of a sliding-window layer for gemma3), prompts
longer than one ubatch, two sessions interleaved in each batch, then greedy decode steps.
"""

from __future__ import annotations

import pytest

from dgr.toolchain.parity import Schedule

from support.engine import (alone_and_shared, assert_split_bundle_exact, baseline_and_split, long_prompts, make_bundle,
                            synth_model)

pytestmark = pytest.mark.engine

# 6 layers; gemma3 (swa_pattern 2): layers 0, 2, 4 slide, 1, 3, 5 are full attention.
SPLITS = {
    "2-uneven": [(0, 1), (1, 6)],
    "3-one-layer": [(0, 2), (2, 3), (3, 6)],     # [2, 3) is one (sliding-window) layer
    "4": [(0, 1), (1, 2), (2, 5), (5, 6)],        # cuts before and after layer 1 (full), before 5
}
ARCHS = ["llama", "qwen2", "qwen3", "gemma3", "qwen3moe"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("synth")
    return {a: synth_model(d, a) for a in ARCHS}


@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("arch", ARCHS)
def test_split_bundle_matches_whole_model_exactly(arch, split, models, engine_lib, tmp_path):
    assert_split_bundle_exact(models[arch], SPLITS[split], tmp_path, engine_lib, f"{arch} {split}")


def test_negative_control_one_perturbed_boundary_value_fails_parity(models, engine_lib, tmp_path):
    whole = models["llama"]
    bundle = make_bundle(whole, SPLITS["3-one-layer"], tmp_path)
    sched = Schedule(prompts=long_prompts(256), steps=2, n_ubatch=16)
    _, _, clean = baseline_and_split(whole, bundle.stage_paths, sched, engine_lib)
    assert clean.exact
    # add 1e-3 to the first value of stage 1's output boundary (session 0, position 0)
    _, _, c = baseline_and_split(whole, bundle.stage_paths, sched, engine_lib, perturb=(1, 0, 0, 1e-3))
    assert not c.exact
    assert c.first_diverging == (0, "prefill", 0)
    assert c.max_abs_diff > 0


def test_range_overrides_on_a_whole_gguf_match_too(models, engine_lib):
    whole = models["qwen3"]
    sched = Schedule(prompts=long_prompts(256, lengths=(23,)), steps=3, n_ubatch=8)
    ranges = [(0, 3), (3, 4), (4, 6)]
    _, _, c = baseline_and_split(whole, [whole] * 3, sched, engine_lib, ranges=ranges)
    assert c.exact, c


def _replay(engines, batches, streams):
    """Run `batches` (lists of (session, n_tokens)) through the stage chain; each session reads its
    next tokens from `streams`. Returns every logits row of the last stage, per batch."""
    import numpy as np

    from dgr.runtime.engine_api import Step

    at = {s: 0 for s in streams}
    for e in engines:
        for s in streams:
            e.open_session(s, 0)
    out = []
    for batch in batches:
        steps = []
        for sid, n in batch:
            pos = np.arange(at[sid], at[sid] + n, dtype=np.int32)
            steps.append((sid, pos, np.asarray(streams[sid][at[sid]: at[sid] + n], dtype=np.int32)))
            at[sid] += n
        bounds = [None] * len(steps)
        for e in engines:
            info = e.describe()
            res = e.forward([Step(sid, 0, pos, token_ids=tok if info.is_first else None,
                                  boundary=None if info.is_first else bounds[k], want_logits="all")
                             for k, (sid, pos, tok) in enumerate(steps)])
            bounds = [r.boundary for r in res]
        out.append([r.logits for r in res])
    return out


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_continuous_batching_sessions_at_different_phases(arch, models, engine_lib):
    """Sessions join, prefill in chunks and decode in the same batches as others, in a ragged
    schedule; the split chain gives the same bits as the whole model under the same schedule."""
    import numpy as np

    from dgr.toolchain.parity import open_stages

    whole = models[arch]
    rng = np.random.default_rng(11)
    streams = {s: rng.integers(0, 256, size=60).tolist() for s in ("a", "b", "c")}
    batches = [[("a", 20)], [("a", 1), ("b", 13)], [("b", 9), ("a", 1), ("c", 30)],
               [("c", 1), ("b", 1), ("a", 5)], [("a", 1), ("c", 1)], [("b", 2), ("c", 3), ("a", 1)]]
    kw = dict(n_ubatch=8, n_ctx=64, max_sessions=3, lib=engine_lib)
    [w] = open_stages([whole], **kw)
    try:
        ref = _replay([w], batches, streams)
    finally:
        w.close()
    stages = open_stages([whole] * 3, ranges=[(0, 2), (2, 3), (3, 6)], **kw)
    try:
        got = _replay(stages, batches, streams)
    finally:
        for e in stages:
            e.close()
    for i, (rb, gb) in enumerate(zip(ref, got)):
        for k, (r, g) in enumerate(zip(rb, gb)):
            assert r.tobytes() == g.tobytes(), f"batch {i}, step {k} differs"


@pytest.mark.parametrize("arch", ARCHS)
def test_sharing_batches_keeps_a_session_bit_identical(arch, models, engine_lib):
    """A session's logits with another session in every batch equal its logits alone, bit for bit
    (batch invariance: before it, these f32 models differed by up to ~2e-4 through llama.cpp's
    shape-dependent kernels and the shared KV cell layout)."""
    a, b = long_prompts(256, lengths=(37, 45))
    alone, shared = alone_and_shared(models[arch], engine_lib, a, b)
    for i, (x, y) in enumerate(zip(alone, shared)):
        assert x.tobytes() == y.tobytes(), f"{arch}: forward {i} max diff {abs(x - y).max()}"
