"""A bounded fuzz run: 100,000 malformed frames on several streams against a live worker process (fake engine).

Every frame gets a typed error back on its stream, the worker stays alive and answers Describe, garbage
that is not even a protobuf message ends only its own stream, and the route then generates the expected
text (the unsplit model's greedy tokens)."""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter

import grpc
import pytest

from dgr.app.local import LocalRoute
from dgr.runtime.wire import codec
from dgr.runtime.wire.client import RouteClient
from dgr.runtime.wire.gen import stage_pb2 as pb, stage_pb2_grpc as pb_grpc
from dgr.testing.fake_engine import FakeModel

from support.fuzz import frame_mutations, whole_model
from support.wire import open_on

SPEC = "layers=6,embd=16,cuts=2:4,hash_layers=3,seed=8"       # stage 1 begins in the hash layers: ids needed
N_FRAMES = int(os.environ.get("DGR_FUZZ_FRAMES", "100000"))
STREAMS = 4
WINDOW = 128                                                  # frames in flight per stream


class Flood:
    """One stream of malformed frames with a bounded window; counts the replies by error code."""

    def __init__(self, address: str, frames, n: int):
        self.channel = grpc.insecure_channel(address)
        self.frames, self.n = frames, n
        self.sent = self.got = 0
        self.codes: Counter = Counter()
        self.bad: list[str] = []
        self.window = threading.Semaphore(WINDOW)
        self.all_back = threading.Event()
        self.error: Exception | None = None

    def _requests(self):
        for _ in range(self.n):
            self.window.acquire()
            self.sent += 1
            yield next(self.frames)
        self.all_back.wait(15)                               # keep the stream open for the last replies

    def run(self, hop: str) -> None:
        try:
            for f in pb_grpc.StageStub(self.channel).Frames(self._requests(), timeout=600):
                self.got += 1
                if f.WhichOneof("body") != "error" or f.error.code == 0 or f.error.hop != hop:
                    self.bad.append(str(f)[:300])
                else:
                    self.codes[pb.ErrorCode.Name(f.error.code)] += 1
                self.window.release()
                if self.got == self.n:
                    self.all_back.set()
        except Exception as e:                               # noqa: BLE001 - reported by the test
            self.error = e
        finally:
            self.all_back.set()
            self.channel.close()


def _garbage_stream(address: str, rng: random.Random) -> str:
    """Bytes that are not a Frame where a Frame goes: the call fails or gets typed errors, nothing else."""
    ch = grpc.insecure_channel(address)
    call = ch.stream_stream("/dgr.v1.Stage/Frames")
    msgs = [bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 200))) for _ in range(50)]
    try:
        for raw in call(iter(msgs), timeout=20):
            f = pb.Frame.FromString(raw)
            assert f.WhichOneof("body") == "error" and f.error.code, f
        return "ended"
    except grpc.RpcError as e:
        return e.code().name
    finally:
        ch.close()


@pytest.fixture(scope="module")
def workers():
    n = len(FakeModel.from_spec(SPEC).ranges)
    with LocalRoute([["--fake-engine", SPEC, "--stage", str(i)] for i in range(n)]) as r:
        yield r


def test_a_hundred_thousand_malformed_frames_then_a_correct_session(workers):
    r = workers
    with RouteClient(r.addresses) as c:
        descs = c.describe()
        ids = c.tokenize("after the storm")
    want = whole_model(SPEC, ids, 16)
    stub = pb_grpc.StageStub(grpc.insecure_channel(r.addresses[1]))
    schema = descs[0].schema_out
    tail = (descs[1].schema_in.n_streams, descs[1].schema_in.n_embd)
    hop = f"stage 1 ({r.addresses[1]})"
    floods = []
    for k in range(STREAMS):
        sid = f"fz{k}"
        assert not open_on(stub, r.addresses, 1, descs, sid, 1).HasField("error")
        gen = frame_mutations(pb, codec, schema, tail, sid, 1, random.Random(100 + k))
        floods.append(Flood(r.addresses[1], gen, N_FRAMES // STREAMS))
    t0 = time.monotonic()
    threads = [threading.Thread(target=f.run, args=(hop,), daemon=True) for f in floods]
    for t in threads:
        t.start()
    # meanwhile: garbage bytes to every stage, and a real session through the route
    rng = random.Random(9)
    garbage = Counter(_garbage_stream(a, rng) for a in r.addresses for _ in range(3))
    with RouteClient(r.addresses) as c:
        during = c.run(ids, max_new_tokens=16).token_ids
    for t in threads:
        t.join(300)
    secs = time.monotonic() - t0
    sent = sum(f.sent for f in floods)
    codes = sum((f.codes for f in floods), Counter())
    print(f"\n{sent} malformed frames on {STREAMS} streams in {secs:.1f} s ({sent / secs:.0f} frames/s): "
          f"{dict(codes)}; garbage streams: {dict(garbage)}")
    for f in floods:
        assert f.error is None, f.error
        assert not f.bad, f.bad[:3]
        assert f.sent == f.got == f.n, (f.sent, f.got)
    assert sent >= N_FRAMES - STREAMS
    assert {"BAD_FRAME", "SCHEMA_MISMATCH", "UNKNOWN_SESSION", "STALE_EPOCH", "CACHE_MISS"} <= set(codes)
    assert during == want
    # the worker is alive, answers Describe, and serves a correct session
    assert all(p.poll() is None for p in r.procs)
    d = stub.Describe(pb.DescribeRequest(), timeout=5)
    assert d.identity.stage_index == 1
    with RouteClient(r.addresses) as c:
        assert c.run(ids, max_new_tokens=16).token_ids == want
        assert c.run("a second prompt", max_new_tokens=8).token_ids == \
            whole_model(SPEC, c.tokenize("a second prompt"), 8)
