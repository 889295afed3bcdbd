"""The 10+ stage scenario: DeepSeek V4's real layer structure (43 main layers + MTP, 3 hash layers, tiny
widths) split 12 ways as the committed contract says, 12 real worker processes on loopback, one thread
each: greedy tokens and every logit equal the whole model's."""

from __future__ import annotations

import numpy as np
import pytest

from dgr.app.certify import load_contract
from dgr.app.certify.fixtures import synth_source, synthetic_bundle
from dgr.app.local import LocalRoute
from dgr.runtime.wire.client import RouteClient

pytestmark = pytest.mark.engine       # ~15 s on 2 shared cores

N_CTX = 256
MAX_NEW = 6
CHUNK = 64


@pytest.fixture(scope="module")
def spec():
    [s] = [s for s in load_contract().contract.gate.synthetic if s.name == "deepseek4-v4shape-12stage"]
    return s


def test_twelve_worker_processes_equal_the_whole_v4_shaped_model(spec, tmp_path, engine_lib):
    from dgr.app.demo import whole_model_run
    from dgr.runtime.engine import Engine

    b = synthetic_bundle(spec, tmp_path)
    m = b.manifest
    assert (m.model.arch, m.model.n_layer, m.model.n_layer_all, m.model.n_hash_layers) == ("deepseek4", 43, 44, 3)
    assert len(m.stages) == 12 and m.stages[-1].layer_end == 43
    assert m.excluded_tensors and all(t.startswith("blk.43.") for t in m.excluded_tensors)   # MTP left out
    # the cut at layer 2 is inside the hash region: that stage takes the token-id sideband, no other does
    assert [bool(s.boundary_in and s.boundary_in.token_ids) for s in m.stages] == [False, True] + [False] * 10
    prompt = np.random.default_rng(5).integers(0, 256, size=150).tolist()   # past the 128-token compression
    with Engine.open(synth_source(spec, tmp_path), lib=engine_lib, n_threads=1, n_ctx=N_CTX) as eng:
        whole = whole_model_run(eng, prompt, MAX_NEW, chunk_tokens=CHUNK)
    args = [["--bundle", str(b.root), "--stage", str(i), "--threads", "1", "--n-ctx", str(N_CTX)] for i in range(12)]
    with LocalRoute(args, env={"DGR_ENGINE_LIB": str(engine_lib)}, timeout=300) as r, \
            RouteClient(r.addresses, chunk_tokens=CHUNK) as c:
        descs = c.describe()
        assert [(d.identity.layer_begin, d.identity.layer_end) for d in descs] == [tuple(x) for x in spec.stages]
        assert all(d.identity.bundle_id == b.id and d.identity.stage_count == 12 for d in descs)
        gen = c.run(prompt, max_new_tokens=MAX_NEW, logits="last", stop_token_ids=[])
        assert len({p.pid for p in r.procs if p.poll() is None}) == 12
    assert gen.token_ids == whole.token_ids
    rows = [gen.logits[len(prompt) - 1 + k] for k in range(MAX_NEW)]
    worst = max(float(np.max(np.abs(a - w))) for a, w in zip(rows, whole.logits))
    assert all(np.array_equal(a, w) for a, w in zip(rows, whole.logits)), f"max |logit diff| {worst}"
