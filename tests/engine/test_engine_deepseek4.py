"""DeepSeek V4 (tiny, random weights) on the same hooks: the mHC boundary [n_tokens, 4, n_embd], the
token-id sideband into stages that start inside the hash-routed layers, compressor/indexer state only
for owned layers; exact parity with the whole model for prompts past the 128-token compression."""

from __future__ import annotations

import numpy as np
import pytest

from dgr.core.errors import SchemaMismatch
from dgr.runtime.engine import Engine
from dgr.runtime.engine_api import Step
from dgr.toolchain.parity import Schedule

from support.engine import baseline_and_split, make_bundle

pytestmark = pytest.mark.engine

# 6 main layers (+ MTP, left out of bundles); hash-routed layers 0, 1, 2; ratios 0, 4, 128, 0, 4, 128
SPLITS = {
    "2-after-hash": [(0, 3), (3, 6)],
    "3-inside-hash": [(0, 1), (1, 2), (2, 6)],
    "4-across": [(0, 2), (2, 3), (3, 5), (5, 6)],
}


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    from dgr.toolchain.synth.deepseek4 import synth_deepseek4

    return synth_deepseek4(tmp_path_factory.mktemp("v4") / "v4.gguf", layers=6, hash_layers=3)


def _prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(0, 256, size=n).tolist() for n in (150, 133)]


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_deepseek4_split_matches_whole_exactly(split, v4, engine_lib, tmp_path):
    bundle = make_bundle(v4, SPLITS[split], tmp_path, name="v4")
    infos = []
    for p in bundle.stage_paths:
        with Engine.open(p, n_ctx=64, max_sessions=1, lib=engine_lib) as e:
            infos.append(e.describe())
    assert all(i.n_streams == 4 for i in infos)
    # the sideband goes exactly to the stages that start inside the hash region
    assert [i.needs_token_ids for i in infos] == [0 < i.layer_begin < 3 for i in infos]
    sched = Schedule(prompts=_prompts(), steps=3, n_ubatch=64)
    base, run, c = baseline_and_split(v4, bundle.stage_paths, sched, engine_lib)
    assert c.exact, f"{split}: max abs {c.max_abs_diff}, first diverging {c.first_diverging}"
    n_tok = sum(len(p) + sched.steps for p in sched.prompts)
    assert run.boundary_bytes == [n_tok * 4 * infos[0].n_embd * 4] * (len(infos) - 1)


def test_deepseek4_stage_needs_its_sideband_and_holds_only_its_state(v4, engine_lib, tmp_path):
    bundle = make_bundle(v4, SPLITS["3-inside-hash"], tmp_path, name="v4")
    with Engine.open(v4, n_ctx=256, max_sessions=1, lib=engine_lib) as whole:
        w = whole.memory()
    with Engine.open(bundle.stage_paths[1], n_ctx=256, max_sessions=1, lib=engine_lib) as e:
        info = e.describe()
        assert (info.layer_begin, info.layer_end, info.needs_token_ids) == (1, 2, True)
        e.open_session("a", 0)
        b = np.zeros((2, 4, info.n_embd), np.float32)
        with pytest.raises(SchemaMismatch, match="sideband"):
            e.forward([Step("a", 0, np.arange(2, dtype=np.int32), boundary=b)])
        with pytest.raises(SchemaMismatch, match=r"\[2, 4, "):
            e.forward([Step("a", 0, np.arange(2, dtype=np.int32), token_ids=np.array([1, 2]),
                            boundary=np.zeros((2, 1, 4 * info.n_embd), np.float32))])
        m = e.memory()
        # the ids matter: layer 1 routes its experts by them (a hash layer)
        rng = np.random.default_rng(1)
        b = rng.standard_normal((6, 4, info.n_embd)).astype(np.float32)
        outs = []
        e.close_session("a", 0)
        for k, ids in enumerate(([1, 2, 3, 4, 5, 6], [9, 8, 7, 6, 5, 4])):
            e.open_session(f"ids{k}", 0)
            outs.append(e.forward([Step(f"ids{k}", 0, np.arange(6, dtype=np.int32), token_ids=np.array(ids),
                                        boundary=b)])[0].boundary)
            e.close_session(f"ids{k}", 0)
        assert not np.array_equal(outs[0], outs[1])
    # one of six layers' state (layer 1, ratio 4: KV, compressor and indexer state) — a part of the whole
    assert 0 < m.kv_bytes < w.kv_bytes / 2


def test_deepseek4_whole_file_with_range_overrides(v4, engine_lib):
    """A whole V4 file: the trunk is block_count less the MTP block, the boundary has the file's 4
    hyper-connection streams, the sideband is derived from its hash-layer count; exact with overrides."""
    with Engine.open(v4, n_ctx=64, max_sessions=1, lib=engine_lib) as e:
        info = e.describe()
    assert (info.arch, info.n_layer, info.n_streams) == ("deepseek4", 6, 4)
    ranges = [(0, 2), (2, 4), (4, 6)]
    sched = Schedule(prompts=_prompts()[:1], steps=2, n_ubatch=64)
    _, _, c = baseline_and_split(v4, [v4] * 3, sched, engine_lib, ranges=ranges)
    assert c.exact, c
    with Engine.open(v4, layer_range=(2, 4), n_ctx=64, max_sessions=1, lib=engine_lib) as e:
        assert e.describe().needs_token_ids


def test_engine_and_python_apply_one_sideband_rule(v4, engine_lib):
    """worker/engine/dgr_contract.h's rule (range overrides of a whole file) is dgr.core.contract's, at every
    start: inside the hash layers (1, 2), at their end (3) and past it, and never on the first stage."""
    from dgr.core.contract import needs_token_ids

    for begin in range(6):
        with Engine.open(v4, layer_range=(begin, 6), n_ctx=64, max_sessions=1, lib=engine_lib) as e:
            assert e.describe().needs_token_ids == needs_token_ids(begin, 3), begin
    assert [needs_token_ids(b, 3) for b in range(6)] == [False, True, True, False, False, False]
