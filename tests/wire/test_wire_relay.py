"""Direct relay over real gRPC on loopback: routes of dgr-worker processes serving the fake engine."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from dgr.app.local import FakeRoute
from dgr.runtime.engine_api import Step
from dgr.runtime.wire import codec
from dgr.runtime.wire.client import RouteClient
from dgr.runtime.wire.errors import Overloaded, RemoteSchemaMismatch, WrongRange, WrongStage
from dgr.runtime.wire.gen import stage_pb2 as pb, stage_pb2_grpc as pb_grpc
from dgr.testing.fake_engine import FakeEngine, FakeModel

from support.wire import RawStream, open_on
from support.worker import describe

SPEC = "layers=8,embd=16,streams=2,cuts=2:5,hash_layers=3,seed=5"


def whole_model(spec: str, ids: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy reference from the unsplit fake model (no wire involved)."""
    e = FakeEngine(FakeModel.from_spec(spec))
    e.open_session("ref", 1)
    r = e.forward([Step("ref", 1, np.arange(len(ids)), np.array(ids), want_logits="last")])[0]
    out, rows, pos = [], [r.logits[-1]], len(ids)
    while True:
        out.append(r.next_token)
        if len(out) == n or r.next_token in e.eos_token_ids():
            return out, rows
        r = e.forward([Step("ref", 1, np.array([pos]), np.array([r.next_token]), want_logits="last")])[0]
        rows.append(r.logits[-1])
        pos += 1


@pytest.fixture(scope="module")
def route():
    with FakeRoute.of(SPEC) as r:
        yield r


@pytest.mark.parametrize("cuts", ["", "4", "2:5", "1:3:6"])
def test_greedy_split_equals_whole_model_tokens_and_logits(cuts):
    spec = f"layers=8,embd=16,streams=2,cuts={cuts},hash_layers=3,seed=5"
    with FakeRoute.of(spec) as r, RouteClient(r.addresses) as c:
        gen = c.run("Split me, then put me back together.", max_new_tokens=24, logits="last")
    ref_ids, ref_rows = whole_model(spec, gen.prompt_ids, 24)
    assert gen.token_ids == ref_ids
    assert len(gen.logits) == len(ref_rows)
    assert all(np.array_equal(gen.logits[p], row) for p, row in zip(sorted(gen.logits), ref_rows))


def test_all_logits_of_the_prompt_come_back(route):
    with RouteClient(route.addresses, chunk_tokens=5) as c:
        gen = c.run("abcdefghijklmnopq", max_new_tokens=3, logits="all")
    e = FakeEngine(FakeModel.from_spec(SPEC))
    e.open_session("ref", 1)
    ids = gen.prompt_ids + gen.token_ids[:-1]
    ref = e.forward([Step("ref", 1, np.arange(len(ids)), np.array(ids), want_logits="all")])[0].logits
    assert sorted(gen.logits) == list(range(len(ids)))
    assert np.array_equal(np.stack([gen.logits[p] for p in range(len(ids))]), ref)


def test_concurrent_sessions_equal_sequential(route):
    prompts = [f"prompt number {i} " * (1 + i % 3) for i in range(8)]
    kws = [dict(max_new_tokens=16, temperature=0.0 if i % 2 else 0.9, top_k=0 if i % 4 else 20,
                top_p=0.9 if i % 3 == 0 else 0.0, seed=i) for i in range(8)]

    def one(i):
        with RouteClient(route.addresses, chunk_tokens=4) as c:
            return c.run(prompts[i], **kws[i]).token_ids

    sequential = [one(i) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        concurrent = list(pool.map(one, range(8)))
    assert concurrent == sequential
    assert len({tuple(s) for s in sequential}) >= 6       # distinct enough that cross-talk would show


def test_cache_miss_reprefills_and_gives_the_same_text():
    # no stop ids: the generation must outlast the eviction after its 6th token (a draw may be EOS early)
    kw = dict(max_new_tokens=40, temperature=0.7, seed=11, stop_token_ids=[])
    at = 1 + len(b"evict me") + 5                         # BOS + the bytes; the step after the 6th token
    # the last stage loses the session's cache right before that step (as under memory pressure): the session
    # stays, its cache is empty, and the step expects more positions than it holds
    evict = ["--test-evict-at", f"victim:1:{at}"]
    with FakeRoute.of(SPEC, extra=lambda stage, _: evict if stage == 2 else []) as r:
        with RouteClient(r.addresses) as c:
            ref = c.run("evict me", **kw)
        with RouteClient(r.addresses) as c:
            gen = c.run("evict me", session_id="victim", **kw)
        log = "".join(r.logs[2])
    assert ref.epochs == 1
    assert f"--test-evict-at victim:1:{at} reached" in log
    assert gen.epochs == 2
    assert [(f.stage, f.code, f.tokens) for f in gen.failures] == [(2, "CACHE_MISS", 6)], gen.failures
    assert gen.token_ids == ref.token_ids and gen.text == ref.text


def test_bad_frames_get_typed_errors_and_the_worker_keeps_serving(route):
    descs = RouteClient(route.addresses).describe()
    stub = pb_grpc.StageStub(grpc.insecure_channel(route.addresses[1]))
    assert not open_on(stub, route.addresses, 1, descs, "raw", 1).HasField("error")
    schema = descs[0].schema_out

    def frame(n=2, epoch=1, sid="raw", shape=None, schema=schema, ids=True, pos0=0, dtype=pb.F32):
        x = np.zeros(shape or (n, 2, 16), np.float32)
        b = codec.encode(x, pb.F32)
        b.dtype = dtype
        return pb.Frame(session_id=sid, epoch=epoch, step=pb.Step(
            positions=range(pos0, pos0 + n), token_ids=[7] * n if ids else [], boundary=b, schema=schema,
            cache_expect=pos0))

    wrong_width = pb.BoundarySchema()
    wrong_width.CopyFrom(schema)
    wrong_width.n_embd = 32
    other_bundle = pb.BoundarySchema()
    other_bundle.CopyFrom(schema)
    other_bundle.bundle_id = "another-bundle"
    wrong_layer = pb.BoundarySchema()
    wrong_layer.CopyFrom(schema)
    wrong_layer.layer = 5

    raw = RawStream(route.addresses[1])
    # a good session in flight through the same worker meanwhile
    with ThreadPoolExecutor(1) as pool:
        busy = pool.submit(lambda: RouteClient(route.addresses).run("busy " * 30, max_new_tokens=30).token_ids)
        cases = {
            "SCHEMA_MISMATCH": [frame(schema=wrong_width), frame(schema=other_bundle), frame(ids=False),
                                frame(dtype=pb.F16)],
            "BAD_FRAME": [frame(shape=(2, 1, 16)), frame(shape=(3, 2, 16))],
            "WRONG_RANGE": [frame(schema=wrong_layer)],
            "UNKNOWN_SESSION": [frame(sid="nobody"), frame(epoch=2)],
            "CACHE_MISS": [frame(pos0=4)],
        }
        for code, frames in cases.items():
            for f in frames:
                reply = raw.ask(f)
                assert reply.WhichOneof("body") == "error", f
                assert pb.ErrorCode.Name(reply.error.code) == code, reply.error.message
                assert reply.error.hop == f"stage 1 ({route.addresses[1]})"
                assert route.addresses[1] in reply.error.message
        # a newer epoch replaces the old one: frames of the old epoch are stale
        assert not open_on(stub, route.addresses, 1, descs, "raw", 2).HasField("error")
        reply = raw.ask(frame(epoch=1))
        assert pb.ErrorCode.Name(reply.error.code) == "STALE_EPOCH"
        miss = raw.ask(frame(epoch=2, pos0=3))
        assert (miss.error.held, miss.error.expected) == (0, 3)
        assert busy.result(timeout=60) == whole_model(SPEC, RouteClient(route.addresses).tokenize("busy " * 30), 30)[0]
    raw.close()


def test_mismatched_bundle_between_hops_is_refused_at_open():
    other = SPEC.replace("seed=5", "seed=6")               # same shapes and ranges, different bundle
    with FakeRoute([(SPEC, 0), (other, 1), (other, 2)]) as r, RouteClient(r.addresses) as c:
        with pytest.raises(RemoteSchemaMismatch) as err:
            c.run("x", max_new_tokens=2)
        msg = str(err.value)
        assert f"stage 0 ({r.addresses[0]})" in msg and f"stage 1 ({r.addresses[1]})" in msg
        assert FakeModel.from_spec(SPEC).bundle_id in msg and FakeModel.from_spec(other).bundle_id in msg
        assert [d.open_sessions for d in _describe_all(r.addresses)] == [0, 0, 0]   # nothing left open


def test_wrong_order_and_wrong_range_are_refused_at_open():
    moved = SPEC.replace("cuts=2:5", "cuts=3:5")
    with FakeRoute([(SPEC, 1), (SPEC, 0), (SPEC, 2)]) as r, RouteClient(r.addresses) as c:
        with pytest.raises(WrongStage, match="hop 0"):
            c.run("x", max_new_tokens=2)
    with FakeRoute([(SPEC, 0), (moved, 1), (moved, 2)]) as r, RouteClient(r.addresses) as c:
        with pytest.raises(RemoteSchemaMismatch):            # another cut is another bundle
            c.run("x", max_new_tokens=2)
    with FakeRoute.of(SPEC) as r, RouteClient(r.addresses) as c:
        c.describe()
        c.hops[1].identity.layer_end = 6                     # the route claims stage 1 owns [2, 6)
        with pytest.raises(WrongRange, match=r"expects stage 1 \[2, 6\).*serves stage 1 \[2, 5\)"):
            c.run("x", max_new_tokens=2)


def test_overloaded_at_open():
    spec = SPEC + ",sessions=2"
    with FakeRoute.of(spec) as r:
        clients = [RouteClient(r.addresses) for _ in range(3)]
        clients[0].open("a", 1, pb.Sampling(), pb.LOGITS_NONE)
        clients[1].open("b", 1, pb.Sampling(), pb.LOGITS_NONE)
        with pytest.raises(Overloaded, match="all 2 sessions are in use"):
            clients[2].open("c", 1, pb.Sampling(), pb.LOGITS_NONE)
        clients[0].close_session("a", 1)
        clients[2].open("c", 1, pb.Sampling(), pb.LOGITS_NONE)


def test_long_prompt_streams_in_chunks_under_the_message_limit():
    spec = "layers=4,embd=64,streams=4,cuts=1:3,seed=2"    # 1 KiB of boundary per token
    limit = 16 * 1024
    prompt = "a long prompt that needs many frames " * 12
    with FakeRoute.of(spec, max_message_bytes=limit) as r, \
            RouteClient(r.addresses, max_message_bytes=limit, chunk_tokens=100) as c:
        gen = c.run(prompt, max_new_tokens=8, logits="last")
        assert gen.chunk_tokens == codec.tokens_per_frame(limit, 64 * 4 * 4) < 100   # capped to one frame
        # a caller that sends bigger chunks: the workers split them into frames under the limit
        c.chunk_tokens = 100
        big = c.run(prompt, max_new_tokens=8, logits="last")
        sent = [d.max_frame_bytes_sent for d in c.describe()]
    assert len(gen.prompt_ids) > 400
    assert all(0 < s <= limit for s in sent[:-1]) and max(sent) > limit // 2, sent
    assert 0 < c.max_frame_bytes_sent <= limit
    assert gen.token_ids == big.token_ids == whole_model(spec, gen.prompt_ids, 8)[0]


def test_wire_dtype_bf16_runs_and_stays_close():
    spec = "layers=6,embd=16,cuts=3,seed=9"
    with FakeRoute.of(spec, wire_dtype="bf16") as r, RouteClient(r.addresses) as c:
        assert c.describe()[0].seam_bytes_per_token == 16 * 2
        gen = c.run("lossy wire", max_new_tokens=1, logits="last")
    _, rows = whole_model(spec, gen.prompt_ids, 1)
    assert np.max(np.abs(gen.logits[len(gen.prompt_ids) - 1] - rows[0])) < 0.1


def test_a_client_that_goes_away_stops_the_ring_and_frees_its_sessions():
    with FakeRoute.of(SPEC) as route, RouteClient(route.addresses) as c:   # its own: "gone" is its only session
        c.open("gone", 1, pb.Sampling(), pb.LOGITS_NONE)
        raw = RawStream(route.addresses[0])
        raw.q.put(pb.Frame(session_id="gone", epoch=1, generate=pb.Generate(max_new_tokens=100000)))
        ids = c.tokenize("walk away")
        first = raw.ask(pb.Frame(session_id="gone", epoch=1, step=pb.Step(
            positions=range(len(ids)), token_ids=ids, cache_expect=0, sample=True)))
        assert first.WhichOneof("body") == "token"
        raw.call.cancel()                                    # no CloseSession: the client just vanishes
        # once the session is closed everywhere, no worker holds a session or a cached position
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_load(d) != (0, 0) for d in _describe_all(route.addresses)):
            time.sleep(0.05)
        assert [_load(d) for d in _describe_all(route.addresses)] == [(0, 0)] * 3


def _describe_all(addresses: list[str]) -> list[pb.StageDescription]:
    return [describe(a) for a in addresses]


def _load(d: pb.StageDescription) -> tuple[int, int]:
    return d.open_sessions, d.cached_positions
