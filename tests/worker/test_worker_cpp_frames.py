"""dgr-worker's data path (issue 21 phase 2, docs/worker.md): routes of dgr-worker processes generate
through the Python client exactly what the model run in this process does: the same tokens, bit-identical
logits (f32 boundaries, CPU), the same draws when sampling, and, with a lossy wire dtype, what the stages do
in this process with every boundary through the codec's numpy conversion (dgr.runtime.wire.codec).

Real processes on loopback, the real engine. A tiny synthetic bundle (3 stages) carries most cases; SmolLM2
split 3 ways is the real model. The references are independent of dgr-worker: dgr.runtime.engine.Engine in this
process (the whole model, or its stages chained here), greedy by numpy's argmax, sampled by
dgr.runtime.engine.sample (the engine library's own dgr_sample, the one sampler dgr-worker draws with).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import count

import grpc
import numpy as np
import pytest

from dgr.runtime.engine import Engine, sample
from dgr.runtime.engine_api import Step
from dgr.runtime.wire import codec
from dgr.runtime.wire.client import RouteClient
from dgr.runtime.wire.errors import RemoteEngineError
from dgr.runtime.wire.gen import stage_pb2 as pb, stage_pb2_grpc as pb_grpc
from dgr.runtime.wire.stats import summarize

from support.engine import make_bundle
from support.worker import FLAGS, N_CTX, RANGES, SAMPLED, cpp_stages, prefill_frame, route_hops

PROMPT = "The three primary colors are"
MAX_NEW = 12


def context_full(position: int, n_ctx: int) -> str:
    """The context-limit error as the worker words it: what the limit is and how to raise it."""
    return (f"the session reached the context limit: position {position} is beyond the {n_ctx} positions "
            f"(0..{n_ctx - 1}) a session may hold on this worker; start the workers with a larger "
            f"`dgr worker serve --n-ctx N` (every stage of the route), or use a shorter prompt or fewer tokens")


def _start(bundle, n, worker_bin, *extra):
    return cpp_stages(worker_bin, bundle, n, *FLAGS, *extra)


@pytest.fixture(scope="module")
def routes(tiny_route, worker_bin):
    """The tiny bundle's 3 stages as dgr-workers."""
    procs = _start(tiny_route[1], 3, worker_bin)
    try:
        yield [p.address for p in procs]
    finally:
        for p in procs:
            print(p.stop()[-2000:])


@pytest.fixture(scope="module")
def whole(tiny_route, engine_lib):
    """The tiny model whole, in this process: the reference."""
    with Engine.open(tiny_route[0], lib=engine_lib, n_threads=1, n_ctx=2 * N_CTX) as eng:
        yield eng


def _run(addresses, prompt=PROMPT, **kw):
    kw.setdefault("max_new_tokens", MAX_NEW)
    kw.setdefault("stop_token_ids", [])
    with RouteClient(addresses) as c:
        return c.run(prompt, **kw)


@dataclass
class Ref:
    token_ids: list[int]
    logits: dict[int, np.ndarray] = field(default_factory=dict)     # position -> row, as Generation.logits


_SIDS = count()


def reference(engines: list[Engine], ids: list[int], max_new: int, *, logits: str = "last", stop=(),
              sampling: dict | None = None, chunk_tokens: int = 0, transform=None) -> Ref:
    """Generation by `engines` in this process (one engine: the whole model; several: its stages chained
    here, each boundary through `transform` when given): the prompt in chunks of `chunk_tokens` (0: one
    step), then one token per step, each drawn from its row greedily (the first maximum) or by
    dgr.runtime.engine.sample keyed by (seed, the row's position). `logits` "all" keeps the prompt's rows too."""
    sid = f"ref{next(_SIDS)}"
    for e in engines:
        e.open_session(sid, 1)

    def forward(positions, tokens, want):
        b = None
        for e in engines:
            info = e.describe()
            r = e.forward([Step(sid, 1, np.asarray(positions, np.int32),
                                np.asarray(tokens, np.int32) if info.is_first or info.needs_token_ids else None,
                                None if info.is_first else b, want_logits=want)])[0]
            if not info.is_last:
                b = r.boundary if transform is None else transform(r.boundary)
        return r

    out = Ref([])
    try:
        step = chunk_tokens or len(ids)
        for lo in range(0, len(ids), step):
            hi = min(len(ids), lo + step)
            r = forward(range(lo, hi), ids[lo:hi], logits)
            if logits == "all":
                out.logits.update({lo + k: row.copy() for k, row in enumerate(r.logits)})
        pos = len(ids) - 1                           # the position of the row the next token is drawn from
        while True:
            row = r.logits[-1].copy()
            out.logits[pos] = row
            tok = sample(row, **sampling, position=pos) if sampling else int(np.argmax(row))
            out.token_ids.append(tok)
            if len(out.token_ids) >= max_new or tok in stop:
                break
            pos += 1
            r = forward([pos], [tok], "last")
    finally:
        for e in engines:
            e.close_session(sid, 1)
    return out


def same(gen, ref: Ref, logits: bool = True):
    """The route's generation is the reference's: the tokens, and every logits row bit for bit."""
    assert gen.token_ids == ref.token_ids
    if logits:
        assert sorted(gen.logits) == sorted(ref.logits)
        for p, row in ref.logits.items():
            assert np.array_equal(gen.logits[p], row), f"position {p}: max |diff| {np.max(np.abs(gen.logits[p] - row))}"


def _same_runs(a, b):
    assert a.token_ids == b.token_ids
    assert a.text == b.text
    assert sorted(a.logits) == sorted(b.logits)
    for p in a.logits:
        assert np.array_equal(a.logits[p], b.logits[p]), p


@pytest.mark.parametrize("logits", ["last", "all"])
def test_greedy_route_equals_whole_model(routes, whole, logits):
    c = _run(routes, logits=logits)
    assert len(c.token_ids) == MAX_NEW
    n = len(c.prompt_ids)
    assert c.prompt_ids == whole.tokenize(PROMPT, add_special=True)
    assert len(c.logits) == (n + MAX_NEW - 1 if logits == "all" else MAX_NEW)
    ref = reference([whole], c.prompt_ids, MAX_NEW, logits=logits)
    same(c, ref)
    assert c.text == whole.detokenize(ref.token_ids)


def test_logits_none_and_timings(routes, whole):
    c = _run(routes)
    assert not c.logits and len(c.token_ids) == MAX_NEW
    same(c, reference([whole], c.prompt_ids, MAX_NEW), logits=False)
    for ev in c.events:                              # every hop reports its timing, the origin the ring
        assert [h[0] for h in ev.timings] == [0, 1, 2]
        assert ev.ring_ns > 0 and ev.return_ns > 0 and all(h[3] > 0 for h in ev.timings)
        assert all(h[1] > 0 for h in ev.timings[1:])      # transit into stages 1 and 2


def test_sampling_equals_whole_model_draws(routes, whole):
    c = _run(routes, logits="last", **SAMPLED)
    ref = reference([whole], c.prompt_ids, MAX_NEW, sampling=SAMPLED)
    same(c, ref)
    assert c.text == whole.detokenize(ref.token_ids)
    assert c.token_ids != reference([whole], c.prompt_ids, MAX_NEW).token_ids      # sampled, not greedy


def test_stop_ids_and_max_tokens(routes, whole):
    greedy = _run(routes)
    assert greedy.token_ids == reference([whole], greedy.prompt_ids, MAX_NEW).token_ids
    stop = greedy.token_ids[4]
    first = greedy.token_ids.index(stop)
    g = _run(routes, stop_token_ids=[stop], logits="last")
    assert g.token_ids == greedy.token_ids[:first + 1]
    same(g, reference([whole], greedy.prompt_ids, MAX_NEW, stop=(stop,)))
    assert _run(routes, max_new_tokens=3).token_ids == greedy.token_ids[:3]


def test_context_limit_is_the_clear_error(routes, whole):
    ids = list(range(10, 10 + 250))                  # 250 positions of 256: rows 249..255 give 7 tokens; the 7th
    with RouteClient(routes) as c:                   # would go in at position 256
        with pytest.raises(RemoteEngineError) as e:
            c.run(ids, max_new_tokens=20, stop_token_ids=[], logits="last", attempts=0)
        got = c.last
    assert str(e.value) == f"{codec.hop_name(0, routes[0])}: {context_full(N_CTX, N_CTX)}"
    # What fit is the whole model's, every draw of it: the draw from the last row (255) too. The origin sends
    # the error after the ring's tokens (origin.cpp deliver_to_client: errors queue behind the tokens being
    # detokenized), so it never overtakes one.
    ref = reference([whole], ids, N_CTX - len(ids) + 1)
    k = len(got.token_ids)
    assert k == N_CTX - len(ids) + 1
    same(got, Ref(ref.token_ids[:k], {p: r for p, r in ref.logits.items() if p < len(ids) - 1 + k}))
    chunk = got.chunk_tokens
    ids = list(range(10, 10 + 300))                  # a prompt past n_ctx is refused at its chunk
    with pytest.raises(RemoteEngineError) as e:
        _run(routes, ids, max_new_tokens=2, attempts=0)
    lo = N_CTX // chunk * chunk                      # the chunk holding position N_CTX
    assert str(e.value) == f"{codec.hop_name(0, routes[0])}: {context_full(min(len(ids), lo + chunk) - 1, N_CTX)}"


def test_concurrent_sessions_equal_sequential_and_whole_model(routes, whole):
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):", PROMPT]
    alone = [_run(routes, q, logits="last") for q in prompts]
    with ThreadPoolExecutor(len(prompts)) as ex:
        together = list(ex.map(lambda q: _run(routes, q, logits="last"), prompts))
    for a, b in zip(alone, together):
        _same_runs(a, b)
        same(a, reference([whole], a.prompt_ids, MAX_NEW))


def test_sessions_sharing_forwards_equal_each_alone_and_the_whole_model(tiny_route, worker_bin, whole):
    """Exact under load: with --hold-batch 4 every stage runs a forward only when steps of 4 sessions wait
    (or of every open one, when fewer are open), so the sessions' steps share forwards, at different
    positions; each session's tokens and every logits row are still the whole model's, bit for bit. The
    workers' own counters say the forwards were shared."""
    import re
    import urllib.request

    prompts = ["The capital of France is", "Once upon a time, in a land far away,", "def f(n):", "1, 2, 3,"]
    n_new = 200                                      # long enough that all four are open together
    procs = _start(tiny_route[1], 3, worker_bin, "--hold-batch", "4", "--metrics-listen", "127.0.0.1:0")
    try:
        addresses = [p.address for p in procs]
        with ThreadPoolExecutor(len(prompts)) as ex:
            together = list(ex.map(lambda q: _run(addresses, q, logits="all", max_new_tokens=n_new), prompts))
        for gen in together:
            same(gen, reference([whole], gen.prompt_ids, n_new, logits="all"))
        for p in procs:
            url = re.search(r"metrics on (\S+)", "".join(p.log)).group(1)
            with urllib.request.urlopen(url, timeout=10) as r:
                text = r.read().decode()
            shared = float(re.search(r'dgr_worker_forwards_total\{sessions="shared"\} (\S+)', text).group(1))
            assert shared > 0, text
    finally:
        for p in procs:
            p.stop()


def test_bad_frames_answer_typed_errors(routes):
    """Frames straight into dgr-worker's stage 0 and 1: each refusal is a typed WireError on the stream."""
    ch = grpc.insecure_channel(routes[0])
    stub = pb_grpc.StageStub(ch)
    descs = [pb_grpc.StageStub(grpc.insecure_channel(a)).Describe(pb.DescribeRequest(), timeout=10) for a in routes]
    hops = route_hops(routes, descs)
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


def test_overloaded_with_retry_hint(tiny_route, worker_bin):
    """A full step queue answers OVERLOADED with retry_after_ms (the hold keeps the first step queued)."""
    procs = _start(tiny_route[1], 3, worker_bin, "--max-queued-steps", "1", "--hold-batch", "2")
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
def smol_route(engine_lib, worker_bin):
    from dgr.app.demo import ensure_bundle

    procs = _start(ensure_bundle(3, progress=False)[0].root, 3, worker_bin)
    try:
        yield [p.address for p in procs]
    finally:
        for p in procs:
            p.stop()


def test_smollm2_three_stages_equal_whole_model(smol_route, smollm2_gguf, engine_lib):
    c = _run(smol_route, logits="last", max_new_tokens=16)
    with Engine.open(smollm2_gguf, lib=engine_lib, n_threads=1, n_ctx=N_CTX) as eng:
        assert c.prompt_ids == eng.tokenize(PROMPT, add_special=True)
        same(c, reference([eng], c.prompt_ids, 16))
        s = _run(smol_route, logits="last", max_new_tokens=16, **SAMPLED)
        same(s, reference([eng], s.prompt_ids, 16, sampling=SAMPLED))
    # the per-hop overhead, measured in one run (no threshold: a report)
    print(f"\nSmolLM2 3 stages, dgr-worker: {summarize(_run(smol_route, max_new_tokens=32), 3)}")


@pytest.mark.parametrize("dtype", ["f16", "bf16", "q8_0"])
def test_lossy_wire_dtypes_equal_the_codec_split(tiny_route, worker_bin, engine_lib, whole, dtype):
    """ggml's converters (the engine library's) in dgr-worker: a route in a lossy wire dtype generates what
    the stages chained in this process do with every boundary through dgr.runtime.wire.codec's numpy conversion
    (equal to ggml's bit for bit), greedy and sampled; which is not what f32 boundaries give."""
    code = codec.DTYPES[dtype]
    lossy = lambda x: codec.decode(codec.encode(x, code))      # noqa: E731
    procs = _start(tiny_route[1], 3, worker_bin, "--wire-dtype", dtype)
    stages = []
    try:
        a = [p.address for p in procs]
        with RouteClient(a) as c:
            assert [h.schema_out.dtype for h in c.describe()[:-1]] == [code, code]
        g = _run(a, logits="last")
        s = _run(a, logits="last", **SAMPLED)
        stages = [Engine.open(tiny_route[0], layer_range=r, lib=engine_lib, n_threads=1, n_ctx=N_CTX) for r in RANGES]
        ref = reference(stages, g.prompt_ids, MAX_NEW, transform=lossy)
        same(g, ref)
        same(s, reference(stages, s.prompt_ids, MAX_NEW, transform=lossy, sampling=SAMPLED))
    finally:
        for e in stages:
            e.close()
        for p in procs:
            p.stop()
    f32 = reference([whole], g.prompt_ids, MAX_NEW)
    assert any(not np.array_equal(ref.logits[p], f32.logits[p]) for p in ref.logits if p in f32.logits)


def test_deepseek4_token_id_sideband_equals_whole_model(tmp_path, engine_lib, worker_bin):
    """V4's hash-routed layers past stage 0 need the token ids beside the boundary: a split inside the hash
    layers through dgr-workers equals the whole model (prefilled in the route's 64-token chunks)."""
    from dgr.toolchain.synth.deepseek4 import synth_deepseek4

    v4 = synth_deepseek4(tmp_path / "v4.gguf", layers=6, hash_layers=3)
    bundle = make_bundle(v4, [(0, 1), (1, 2), (2, 6)], tmp_path / "store", name="v4").root
    prompt = np.random.default_rng(11).integers(0, 256, size=150).tolist()
    procs = _start(bundle, 3, worker_bin)
    try:
        descs = [p.stub.Describe(pb.DescribeRequest(), timeout=10) for p in procs]
        assert [d.schema_in.token_ids for d in descs[1:]] == [True, True]      # both own a hash layer
        gen = _run([p.address for p in procs], prompt, max_new_tokens=4, logits="last")
    finally:
        for p in procs:
            p.stop()
    assert gen.chunk_tokens == 64
    with Engine.open(v4, lib=engine_lib, n_threads=1, n_ctx=N_CTX) as eng:
        same(gen, reference([eng], prompt, 4, chunk_tokens=64))
