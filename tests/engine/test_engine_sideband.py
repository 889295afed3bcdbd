"""The token-id sideband (DeepSeek V4's hash-routed layers need the token ids past stage 0): a stage
whose file says dgr.boundary.token_ids takes each token's id together with its boundary row in the
same batch entry, exposed to the graph as its token input; without it the step is refused (typed)."""

from __future__ import annotations

import numpy as np
import pytest

from dgr.core.errors import SchemaMismatch
from dgr.runtime.engine import Engine
from dgr.runtime.engine_api import Step
from dgr.toolchain.parity import Schedule

from support.engine import baseline_and_split, long_prompts, make_bundle, rewrite_gguf, synth_model

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    d = tmp_path_factory.mktemp("sb")
    whole = synth_model(d, "llama")
    b = make_bundle(whole, [(0, 2), (2, 4), (4, 6)], d)
    mid = rewrite_gguf(b.stage_paths[1], d / "mid-sideband.gguf", set_kv={"dgr.boundary.token_ids": True})
    return whole, [b.stage_paths[0], mid, b.stage_paths[2]]


def test_sideband_stage_describes_itself_and_keeps_parity(stages, engine_lib):
    whole, paths = stages
    with Engine.open(paths[1], n_ctx=32, max_sessions=1, lib=engine_lib) as e:
        info = e.describe()
    assert info.needs_token_ids and not info.is_first
    sched = Schedule(prompts=long_prompts(256), steps=3, n_ubatch=16)
    _, _, c = baseline_and_split(whole, paths, sched, engine_lib)
    assert c.exact, c


def test_missing_sideband_is_a_typed_error(stages, engine_lib):
    _, paths = stages
    with Engine.open(paths[1], n_ctx=32, max_sessions=1, lib=engine_lib) as e:
        e.open_session("a", 0)
        b = np.zeros((2, 1, 64), np.float32)
        with pytest.raises(SchemaMismatch, match="sideband"):
            e.forward([Step("a", 0, np.arange(2, dtype=np.int32), boundary=b)])
        assert e.n_cached("a", 0) == 0
        r = e.forward([Step("a", 0, np.arange(2, dtype=np.int32), token_ids=np.array([3, 4]), boundary=b)])
        assert r[0].n_cached == 2
