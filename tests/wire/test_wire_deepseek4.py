"""DeepSeek V4 (tiny, random weights) through real worker processes: the mHC boundary [n, 4, n_embd] and
the token-id sideband cross process boundaries over gRPC; greedy generation with prompts past the
128-token compression equals the whole model token for token with equal logits, for cuts inside
(after layer 1, after layer 2) and after the hash-routed layers 0-2, over 2, 3 and 4 stages. (A cut
*before* the hash region would be at layer 0: V4's hash layers are always the first ones, so every
route's stage 0 starts with them.) Through dgr-worker processes. A frame without the sideband gets
SCHEMA_MISMATCH, not numbers."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from dgr.app.local import LocalRoute
from dgr.runtime.wire import codec
from dgr.runtime.wire.client import RouteClient
from dgr.runtime.wire.gen import stage_pb2 as pb, stage_pb2_grpc as pb_grpc

from support.engine import make_bundle
from support.wire import RawStream, open_on

pytestmark = pytest.mark.engine       # ~15 s on 2 shared cores

N_CTX = 256
MAX_NEW = 4
CHUNK = 64
# 6 main layers (+ MTP, left out of bundles); hash-routed layers 0, 1, 2; ratios 0, 4, 128, 0, 4, 128
SPLITS = {
    "2-after-hash": [(0, 3), (3, 6)],
    "3-inside-hash": [(0, 1), (1, 2), (2, 6)],
    "4-inside-and-after": [(0, 1), (1, 2), (2, 3), (3, 6)],
}


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    from dgr.toolchain.synth.deepseek4 import synth_deepseek4

    return synth_deepseek4(tmp_path_factory.mktemp("v4w") / "v4.gguf", layers=6, hash_layers=3)


@pytest.fixture(scope="module")
def prompt():
    return np.random.default_rng(11).integers(0, 256, size=150).tolist()


@pytest.fixture(scope="module")
def whole(v4, prompt, engine_lib):
    """The unsplit file on one engine, prefilled in the route's chunks (CHUNK), then greedy."""
    from dgr.app.demo import whole_model_run
    from dgr.runtime.engine import Engine

    with Engine.open(v4, lib=engine_lib, n_threads=1, n_ctx=N_CTX) as eng:
        return whole_model_run(eng, prompt, MAX_NEW, chunk_tokens=CHUNK)


@pytest.fixture(scope="module")
def bundles(v4, tmp_path_factory):
    d = tmp_path_factory.mktemp("v4w-bundles")
    return {k: make_bundle(v4, r, d / k, name=f"v4-{k}") for k, r in SPLITS.items()}


def _route(engine_lib, bundle):
    return LocalRoute([["--bundle", str(bundle.root), "--stage", str(i), "--threads", "1", "--n-ctx", str(N_CTX)]
                       for i in range(len(bundle.manifest.stages))],
                      env={"DGR_ENGINE_LIB": str(engine_lib)}, timeout=300)


def _needs_ids(ranges):
    return [0 < b < 3 for b, _ in ranges]


def _check_generation(c, prompt, whole):
    gen = c.run(prompt, max_new_tokens=MAX_NEW, logits="last", stop_token_ids=[])
    assert gen.chunk_tokens == CHUNK
    assert gen.token_ids == whole.token_ids
    rows = [gen.logits[len(prompt) - 1 + k] for k in range(MAX_NEW)]
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(rows, whole.logits))
    assert all(np.array_equal(a, b) for a, b in zip(rows, whole.logits)), f"max |logit diff| {worst}"


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_deepseek4_through_worker_processes_equals_whole_model(split, bundles, prompt, whole, engine_lib):
    b = bundles[split]
    ranges = SPLITS[split]
    m = b.manifest
    # the manifest: 4 streams at every seam, the sideband exactly into stages that start inside the hash region
    assert (m.model.arch, m.model.n_streams, m.model.n_hash_layers) == ("deepseek4", 4, 3)
    assert [s.boundary_in.token_ids if s.boundary_in else False for s in m.stages] == _needs_ids(ranges)
    assert all(s.boundary_out.n_streams == 4 for s in m.stages[:-1])
    assert all(s.boundary_in.n_streams == 4 for s in m.stages[1:])
    with _route(engine_lib, b) as r, RouteClient(r.addresses, chunk_tokens=CHUNK) as c:
        descs = c.describe()
        # Describe says the same: schema in/out of 4 streams, which stages need the sideband
        assert [(d.identity.layer_begin, d.identity.layer_end) for d in descs] == ranges
        assert [d.schema_in.token_ids for d in descs[1:]] == _needs_ids(ranges)[1:]
        assert all(d.schema_in.n_streams == 4 for d in descs[1:])
        assert all(d.schema_out.n_streams == 4 and d.schema_out.token_ids for d in descs[:-1])
        _check_generation(c, prompt, whole)
        after = c.describe()
        assert all(0 < d.max_frame_bytes_sent <= d.max_message_bytes for d in after[:-1])


def test_deepseek4_frame_without_the_sideband_is_refused_and_the_worker_keeps_serving(
        bundles, prompt, whole, engine_lib):
    b = bundles["3-inside-hash"]
    with _route(engine_lib, b) as r, RouteClient(r.addresses, chunk_tokens=CHUNK) as c:
        descs = c.describe()
        assert descs[1].schema_in.token_ids and descs[1].schema_in.n_streams == 4
        stub = pb_grpc.StageStub(grpc.insecure_channel(r.addresses[1]))
        assert not open_on(stub, r.addresses, 1, descs, "raw", 1).HasField("error")
        n, n_embd = 3, descs[1].schema_in.n_embd
        x = np.random.default_rng(2).standard_normal((n, 4, n_embd)).astype(np.float32)

        def frame(ids):
            return pb.Frame(session_id="raw", epoch=1, step=pb.Step(
                positions=range(n), token_ids=ids, boundary=codec.encode(x, pb.F32),
                schema=descs[0].schema_out, cache_expect=0))

        raw = RawStream(r.addresses[1])
        try:
            for ids in ([], [5]):                      # no sideband; a sideband of the wrong length
                reply = raw.ask(frame(ids))
                assert reply.WhichOneof("body") == "error", reply
                assert pb.ErrorCode.Name(reply.error.code) == "SCHEMA_MISMATCH", reply.error.message
                assert "sideband" in reply.error.message
                assert reply.error.hop == f"stage 1 ({r.addresses[1]})"
        finally:
            raw.close()
        # nothing ran for the refused frames, and the worker goes on serving: a full session is exact
        _check_generation(c, prompt, whole)
