"""Wrong inputs get typed errors that say what to do, never a crash."""

from __future__ import annotations

import numpy as np
import pytest

from dgr.core.errors import CacheMiss, EngineError, SchemaMismatch
from dgr.runtime.engine import Engine
from dgr.runtime.engine_api import Step

from support.engine import make_bundle, rewrite_gguf, synth_model

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def llama6(tmp_path_factory):
    return synth_model(tmp_path_factory.mktemp("m"), "llama")


@pytest.fixture(scope="module")
def bundle(llama6, tmp_path_factory):
    return make_bundle(llama6, [(0, 2), (2, 4), (4, 6)], tmp_path_factory.mktemp("b"))


def test_wrong_boundary_width_is_a_schema_mismatch(bundle, engine_lib):
    with Engine.open(bundle.stage_paths[1], n_ctx=64, max_sessions=1, lib=engine_lib) as e:
        e.open_session("a", 0)
        pos = np.arange(3, dtype=np.int32)
        with pytest.raises(SchemaMismatch, match=r"\[3, 1, 64\]"):
            e.forward([Step("a", 0, pos, boundary=np.zeros((3, 1, 63), np.float32))])
        with pytest.raises(SchemaMismatch, match="float32"):
            e.forward([Step("a", 0, pos, boundary=np.zeros((3, 1, 64), np.float64))])
        with pytest.raises(SchemaMismatch, match="needs the boundary"):
            e.forward([Step("a", 0, pos, token_ids=np.array([1, 2, 3]))])
        # nothing was computed: the session still holds no position, and a right step works
        assert e.n_cached("a", 0) == 0
        r = e.forward([Step("a", 0, pos, boundary=np.ones((3, 1, 64), np.float32))])
        assert r[0].boundary.shape == (3, 1, 64) and r[0].n_cached == 3


def test_positions_must_continue_the_cache(bundle, engine_lib):
    with Engine.open(bundle.stage_paths[0], n_ctx=64, max_sessions=2, lib=engine_lib) as e:
        e.open_session("a", 0)
        e.forward([Step("a", 0, np.arange(4, dtype=np.int32), token_ids=np.array([5, 6, 7, 8]))])
        with pytest.raises(CacheMiss) as err:
            e.forward([Step("a", 0, np.array([6], np.int32), token_ids=np.array([9]))])
        assert (err.value.held, err.value.expected) == (4, 6)
        assert "re-prefill" in str(err.value)
        with pytest.raises(CacheMiss):  # a session that is not open here (e.g. a stale epoch)
            e.forward([Step("a", 1, np.array([4], np.int32), token_ids=np.array([9]))])
        with pytest.raises(SchemaMismatch, match="vocabulary"):
            e.forward([Step("a", 0, np.array([4], np.int32), token_ids=np.array([10**6]))])
        # a failed step in a batch runs none of the batch
        e.open_session("b", 0)
        with pytest.raises(CacheMiss):
            e.forward([Step("b", 0, np.array([0], np.int32), token_ids=np.array([1])),
                       Step("a", 0, np.array([9], np.int32), token_ids=np.array([1]))])
        assert e.n_cached("b", 0) == 0
        # a new epoch replaces the old one, with an empty cache
        e.open_session("a", 1)
        assert e.n_cached("a", 1) == 0
        with pytest.raises(EngineError, match="not open"):
            e.n_cached("a", 0)


def test_stage_file_whose_keys_contradict_its_tensors_is_refused(bundle, engine_lib, tmp_path):
    src = bundle.stage_paths[1]  # layers [2, 4)
    bad = rewrite_gguf(src, tmp_path / "bad-range.gguf", set_kv={"dgr.layer.end": 5})
    with pytest.raises(EngineError, match="no tensors of layer 4"):
        Engine.open(bad, lib=engine_lib)
    bad = rewrite_gguf(src, tmp_path / "bad-begin.gguf", set_kv={"dgr.layer.begin": 3})
    with pytest.raises(EngineError, match="tensors of layer 2"):
        Engine.open(bad, lib=engine_lib)
    bad = rewrite_gguf(bundle.stage_paths[0], tmp_path / "no-embd.gguf", drop_tensors=("token_embd.weight",))
    with pytest.raises(EngineError, match="token_embd"):
        Engine.open(bad, lib=engine_lib)
    bad = rewrite_gguf(src, tmp_path / "bad-total.gguf", set_kv={"dgr.layer.total": 7})
    with pytest.raises(EngineError, match="block_count"):
        Engine.open(bad, lib=engine_lib)
    # truncated file
    raw = src.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(EngineError, match="cut.gguf"):
        Engine.open(tmp_path / "cut.gguf", lib=engine_lib)
    # a range override on a stage file
    with pytest.raises(EngineError, match="stage file"):
        Engine.open(src, layer_range=(0, 1), lib=engine_lib)


def test_unported_architecture_refuses_a_range(llama6, engine_lib, tmp_path):
    # the same weights declared as `nanbeige` (llama-like tensors), an architecture without the dgr opt-in
    other = rewrite_gguf(llama6, tmp_path / "unported.gguf", arch=UNPORTED_ARCH)
    with Engine.open(other, n_ctx=32, max_sessions=1, lib=engine_lib) as whole:
        assert whole.describe().arch == UNPORTED_ARCH  # as a whole model it loads
    with pytest.raises(EngineError, match=f"'{UNPORTED_ARCH}' is not yet ported to layer ranges"):
        Engine.open(other, layer_range=(0, 3), lib=engine_lib)


UNPORTED_ARCH = "nanbeige"  # looped layers: a range of a looped model is left unported



def test_an_unknown_or_contradictory_kernel_set_is_refused_by_name(llama6, engine_lib):
    with pytest.raises(EngineError, match="kernels must be one of reference, fast, invariant, got 'turbo'"):
        Engine.open(llama6, kernels="turbo", lib=engine_lib)
    with pytest.raises(EngineError, match="fast_kernels=True and kernels='invariant' ask for two kernel sets"):
        Engine.open(llama6, fast_kernels=True, kernels="invariant", lib=engine_lib)
