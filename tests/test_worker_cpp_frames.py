"""dgr-worker's data path (issue 21 phase 2, docs/worker.md): routes of dgr-worker processes generate
through the Python client exactly what routes of Python workers (`dgr worker serve`) generate, and what
the whole model does: the same tokens, bit-identical logits (f32 boundaries, CPU).

Real processes on loopback, the real engine. A tiny synthetic bundle (3 stages) carries most cases; SmolLM2
split 3 ways is the real model. Mixed routes (dgr-worker beside Python workers) speak the same frames.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from dgr.wire.client import RouteClient
from dgr.wire.errors import StageError
from dgr.wire.gen import stage_pb2 as pb
from dgr.wire.gen import stage_pb2_grpc as pb_grpc
from dgr.wire.stats import summarize
from support.engine import make_bundle, synth_model
from support.worker import prefill_frame, route_hops
from test_worker_cpp import cpp, py, worker_bin  # noqa: F401  (worker_bin: the fixture)

PROMPT = "The three primary colors are"
MAX_NEW = 12
SAMPLED = dict(temperature=0.9, top_k=40, top_p=0.95, seed=11)
FLAGS = ("--threads", "1", "--n-ctx", "256")


def _start(kind, bundle, n, worker_bin, *extra):
    procs = []
    try:
        for i in range(n):
            procs.append(cpp(worker_bin, bundle, i, *FLAGS, *extra) if kind == "cpp" else py(bundle, i, *FLAGS, *extra))
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, engine_lib):
    d = tmp_path_factory.mktemp("cpp-frames")
    src = synth_model(d, "llama", layers=6)
    return src, make_bundle(src, [(0, 2), (2, 4), (4, 6)], d / "store").root


@pytest.fixture(scope="module")
def routes(tiny, worker_bin):
    """The tiny bundle's 3 stages, once as dgr-workers and once as Python workers."""
    out = {}
    try:
        for kind in ("cpp", "py"):
            out[kind] = _start(kind, tiny[1], 3, worker_bin)
        yield {k: [p.address for p in v] for k, v in out.items()}
    finally:
        for v in out.values():
            for p in v:
                print(p.stop()[-2000:])


def _run(addresses, prompt=PROMPT, **kw):
    kw.setdefault("max_new_tokens", MAX_NEW)
    kw.setdefault("stop_token_ids", [])
    with RouteClient(addresses) as c:
        return c.run(prompt, **kw)


def _same(a, b):
    assert a.token_ids == b.token_ids
    assert a.text == b.text
    assert sorted(a.logits) == sorted(b.logits)
    for p in a.logits:
        assert np.array_equal(a.logits[p], b.logits[p]), f"position {p}: max |diff| {np.max(np.abs(a.logits[p] - b.logits[p]))}"


def _whole(gguf, engine_lib, ids, max_new):
    from dgr.app.demo import whole_model_run
    from dgr.engine import Engine

    eng = Engine.open(gguf, lib=engine_lib, n_threads=1)
    try:
        return whole_model_run(eng, ids, max_new)
    finally:
        eng.close()


@pytest.mark.parametrize("logits", ["last", "all"])
def test_greedy_route_equals_python_route_and_whole_model(routes, tiny, engine_lib, logits):
    c = _run(routes["cpp"], logits=logits)
    p = _run(routes["py"], logits=logits)
    _same(c, p)
    assert len(c.token_ids) == MAX_NEW
    n = len(c.prompt_ids)
    assert len(c.logits) == (n + MAX_NEW - 1 if logits == "all" else MAX_NEW)
    ref = _whole(tiny[0], engine_lib, c.prompt_ids, MAX_NEW)
    assert c.token_ids == ref.token_ids
    for k, row in enumerate(ref.logits):
        assert np.array_equal(c.logits[n - 1 + k], row)


def test_logits_none_and_timings(routes):
    c = _run(routes["cpp"])
    assert not c.logits and len(c.token_ids) == MAX_NEW
    assert c.token_ids == _run(routes["py"]).token_ids
    for ev in c.events:                              # every hop reports its timing, the origin the ring
        assert [h[0] for h in ev.timings] == [0, 1, 2]
        assert ev.ring_ns > 0 and ev.return_ns > 0 and all(h[3] > 0 for h in ev.timings)
        assert all(h[1] > 0 for h in ev.timings[1:])      # transit into stages 1 and 2


def test_sampling_equals_python_route(routes):
    c = _run(routes["cpp"], logits="last", **SAMPLED)
    _same(c, _run(routes["py"], logits="last", **SAMPLED))
    assert c.token_ids != _run(routes["cpp"]).token_ids      # sampled, not greedy


def test_stop_ids_and_max_tokens(routes):
    greedy = _run(routes["cpp"])
    stop = greedy.token_ids[4]
    first = greedy.token_ids.index(stop)
    for kind in ("cpp", "py"):
        g = _run(routes[kind], stop_token_ids=[stop])
        assert g.token_ids == greedy.token_ids[:first + 1]
        assert _run(routes[kind], max_new_tokens=3).token_ids == greedy.token_ids[:3]


def test_context_limit_is_the_clear_error(routes):
    ids = list(range(10, 10 + 250))                  # 250 positions of 256: the 7th token needs position 256
    msgs = {}
    for kind in ("cpp", "py"):
        with pytest.raises(StageError) as e:
            _run(routes[kind], ids, max_new_tokens=20, attempts=0)
        msgs[kind] = str(e.value)
    assert "context limit" in msgs["cpp"] and "--n-ctx" in msgs["cpp"]
    norm = {k: v.replace(routes[k][0], "<origin>") for k, v in msgs.items()}
    assert norm["cpp"] == norm["py"]
    with pytest.raises(StageError) as e:              # a prompt past n_ctx is refused at its chunk
        _run(routes["cpp"], list(range(10, 10 + 300)), max_new_tokens=2, attempts=0)
    assert "context limit" in str(e.value)


def test_concurrent_sessions_equal_sequential(routes):
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):", PROMPT]
    alone = [_run(routes["cpp"], q, logits="last") for q in prompts]
    with ThreadPoolExecutor(len(prompts)) as ex:
        together = list(ex.map(lambda q: _run(routes["cpp"], q, logits="last"), prompts))
    for a, b in zip(alone, together):
        _same(a, b)


def test_mixed_routes_equal(routes):
    ref = _run(routes["py"], logits="last", **SAMPLED)
    for pick in (("cpp", "py", "cpp"), ("py", "cpp", "py")):
        mixed = [routes[k][i] for i, k in enumerate(pick)]
        _same(_run(mixed, logits="last", **SAMPLED), ref)


def test_bad_frames_answer_typed_errors(routes):
    """Frames straight into dgr-worker's stage 0 and 1: each refusal is a typed WireError on the stream."""
    cpp_addr = routes["cpp"]
    ch = grpc.insecure_channel(cpp_addr[0])
    stub = pb_grpc.StageStub(ch)
    descs = [pb_grpc.StageStub(grpc.insecure_channel(a)).Describe(pb.DescribeRequest(), timeout=10) for a in cpp_addr]
    hops = route_hops(cpp_addr, descs)
    assert not stub.OpenSession(pb.OpenSessionRequest(session_id="bad", epoch=1, route=hops), timeout=30).HasField("error")
    frames = [pb.Frame(session_id="nope", epoch=1, step=pb.Step(positions=[0], token_ids=[1])),
              pb.Frame(session_id="bad", epoch=1, step=pb.Step(positions=[0, 2], token_ids=[1, 2])),
              pb.Frame(session_id="bad", epoch=1, step=pb.Step(positions=[3], token_ids=[1], cache_expect=3)),
              pb.Frame(session_id="bad", epoch=1, step=pb.Step(positions=[0], token_ids=[1, 2]))]
    done = threading.Event()

    def send():                                      # the stream stays open until every answer is read:
        yield from frames                            # the cache miss comes from the engine thread, later
        done.wait(30)

    call = stub.Frames(send(), timeout=30)
    got = {}
    for r in call:
        got.setdefault(r.error.code, []).append(r.error.message)
        if sum(map(len, got.values())) == len(frames):
            break
    done.set()
    call.cancel()
    assert {c: len(m) for c, m in got.items()} == {pb.UNKNOWN_SESSION: 1, pb.BAD_FRAME: 2, pb.CACHE_MISS: 1}
    assert any("positions must be contiguous" in m for m in got[pb.BAD_FRAME])
    assert "holds 0 positions here but the frame expects 3" in got[pb.CACHE_MISS][0]
    ch.close()


def test_overloaded_with_retry_hint(tiny, worker_bin):
    """A full step queue answers OVERLOADED with retry_after_ms (the hold keeps the first step queued)."""
    procs = _start("cpp", tiny[1], 3, worker_bin, "--max-queued-steps", "1", "--hold-batch", "2")
    try:
        addrs = [p.address for p in procs]
        descs = [p.stub.Describe(pb.DescribeRequest(), timeout=10) for p in procs]
        s = procs[0].stub
        assert not s.OpenSession(pb.OpenSessionRequest(session_id="o", epoch=1, route=route_hops(addrs, descs)),
                                 timeout=30).HasField("error")
        frames = [prefill_frame("o", 1, [1, 2, 3]), prefill_frame("o", 1, [4, 5], start=3)]
        call = s.Frames(iter(frames + [pb.Frame(session_id="o", epoch=1, step=pb.Step(positions=[5], token_ids=[6],
                                                                                      cache_expect=5))]), timeout=5)
        first = next(iter(call))
        call.cancel()
        assert first.error.code == pb.OVERLOADED and first.error.retry_after_ms >= 50
        assert "--max-queued-steps 1" in first.error.message
        assert s.Describe(pb.DescribeRequest(), timeout=10).overloaded >= 1
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def smol_routes(engine_lib, worker_bin):
    from dgr.app.demo import ensure_bundle

    b = ensure_bundle(3, progress=False)[0]
    out = {}
    try:
        for kind in ("cpp", "py"):
            out[kind] = _start(kind, b.root, 3, worker_bin)
        yield {k: [p.address for p in v] for k, v in out.items()}
    finally:
        for v in out.values():
            for p in v:
                p.stop()


def test_smollm2_three_stages_equal_python_and_whole_model(smol_routes, smollm2_gguf, engine_lib):
    c = _run(smol_routes["cpp"], logits="last", max_new_tokens=16)
    p = _run(smol_routes["py"], logits="last", max_new_tokens=16)
    _same(c, p)
    ref = _whole(smollm2_gguf, engine_lib, c.prompt_ids, 16)
    n = len(c.prompt_ids)
    assert c.token_ids == ref.token_ids
    assert all(np.array_equal(c.logits[n - 1 + k], row) for k, row in enumerate(ref.logits))
    # the per-hop overhead, measured in one run (no threshold: a report)
    c = _run(smol_routes["cpp"], max_new_tokens=32)
    p = _run(smol_routes["py"], max_new_tokens=32)
    print(f"\nSmolLM2 3 stages, dgr-worker: {summarize(c, 3)}\nSmolLM2 3 stages, python:     {summarize(p, 3)}")


@pytest.mark.parametrize("dtype", ["f16", "bf16", "q8_0"])
def test_lossy_wire_dtypes_equal_python_route(tiny, worker_bin, dtype):
    """ggml's converters (the engine library's) on both sides: a dgr-worker route, and mixed routes where
    dgr-worker encodes for a Python worker and decodes a Python worker's frames, equal the Python route."""
    procs = {}
    try:
        for kind in ("cpp", "py"):
            procs[kind] = _start(kind, tiny[1], 3, worker_bin, "--wire-dtype", dtype)
        a = {k: [p.address for p in v] for k, v in procs.items()}
        ref = _run(a["py"], logits="last")
        for pick in (("cpp", "cpp", "cpp"), ("cpp", "py", "cpp"), ("py", "cpp", "py")):
            _same(_run([a[k][i] for i, k in enumerate(pick)], logits="last"), ref)
        assert ref.token_ids == _run(a["cpp"], logits="last").token_ids
    finally:
        for v in procs.values():
            for p in v:
                p.stop()


def test_deepseek4_token_id_sideband_equals_whole_model(tmp_path, engine_lib, worker_bin):
    """V4's hash-routed layers past stage 0 need the token ids beside the boundary: a split inside the hash
    layers through dgr-workers equals the whole model (prefilled in the route's 64-token chunks)."""
    from dgr.app.demo import whole_model_run
    from dgr.engine import Engine
    from dgr.synth_deepseek4 import synth_deepseek4

    v4 = synth_deepseek4(tmp_path / "v4.gguf", layers=6, hash_layers=3)
    bundle = make_bundle(v4, [(0, 1), (1, 2), (2, 6)], tmp_path / "store", name="v4").root
    prompt = np.random.default_rng(11).integers(0, 256, size=150).tolist()
    with Engine.open(v4, lib=engine_lib, n_threads=1, n_ctx=256) as eng:
        whole = whole_model_run(eng, prompt, 4, chunk_tokens=64)
    procs = _start("cpp", bundle, 3, worker_bin)
    try:
        descs = [p.stub.Describe(pb.DescribeRequest(), timeout=10) for p in procs]
        assert [d.schema_in.token_ids for d in descs[1:]] == [True, True]      # both own a hash layer
        gen = _run([p.address for p in procs], prompt, max_new_tokens=4, logits="last")
    finally:
        for p in procs:
            p.stop()
    assert gen.chunk_tokens == 64 and gen.token_ids == whole.token_ids
    assert all(np.array_equal(gen.logits[len(prompt) - 1 + k], row) for k, row in enumerate(whole.logits))
