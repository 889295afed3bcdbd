"""dgr-worker's speculative decoding (issue 21 phase 4, docs/worker.md): n-gram drafts at the origin
(worker/server/drafts.cpp, the port of dgr.wire.drafts), verified by the last stage in the same ring, rejected
drafts rolled back on every stage. A route of dgr-workers with speculation generates exactly what it does
without (tokens, text, bit-identical logits) and what a route of Python workers does with speculation, ring
for ring (the same drafts accepted at the same tokens).

Real processes on loopback, the real engine, the tiny synthetic bundle of tests/test_worker_cpp_frames.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from dgr.wire.client import RouteClient
from dgr.wire.gen import stage_pb2 as pb
from dgr.wire.stats import draft_stats, tokens_per_ring
from support.worker import prefill_frame, route_hops
from test_worker_cpp import worker_bin  # noqa: F401  (worker_bin: the fixture)
from test_worker_cpp_frames import SAMPLED, _same, routes, tiny  # noqa: F401  (fixtures)

# a prompt that restates itself: prompt lookup finds what follows, and the tiny model's greedy loop too
PROMPT = [1] + [20, 21, 22, 23, 24, 25] * 6
MAX_NEW = 48


def _run(addresses, **kw):
    kw.setdefault("max_new_tokens", MAX_NEW)
    kw.setdefault("stop_token_ids", [])
    with RouteClient(addresses) as c:
        return c.run(PROMPT, **kw)


def _rings(gen):
    return [e.speculated for e in gen.events]


@pytest.mark.parametrize("logits", ["last", "all"])
def test_speculative_greedy_equals_plain_and_the_python_route(routes, logits):
    plain = _run(routes["cpp"], logits=logits)
    fast = _run(routes["cpp"], logits=logits, speculate="ngram")
    _same(fast, plain)                                # no rows of rejected drafts either
    drafted, accepted = draft_stats(fast)
    assert drafted > 0 and accepted > 0 and tokens_per_ring(fast) > 1.0, (drafted, accepted)
    assert tokens_per_ring(plain) == 1.0 and draft_stats(plain) == (0, 0)
    py = _run(routes["py"], logits=logits, speculate="ngram")
    _same(fast, py)
    assert _rings(fast) == _rings(py)                 # the same drafts, accepted at the same tokens
    assert draft_stats(fast) == draft_stats(py)


def test_speculative_sampling_equals_plain_and_the_python_route(routes):
    plain = _run(routes["cpp"], logits="last", **SAMPLED)
    fast = _run(routes["cpp"], logits="last", speculate="ngram", draft_k=6, **SAMPLED)
    _same(fast, plain)
    py = _run(routes["py"], logits="last", speculate="ngram", draft_k=6, **SAMPLED)
    _same(fast, py)
    assert _rings(fast) == _rings(py)


def test_mixed_route_speculates_alike(routes):
    mixed = [routes["cpp"][0], routes["py"][1], routes["cpp"][2]]
    other = [routes["py"][0], routes["cpp"][1], routes["py"][2]]
    want = _run(routes["py"], logits="last", speculate="ngram")
    for r in (mixed, other):
        got = _run(r, logits="last", speculate="ngram")
        _same(got, want)
        assert _rings(got) == _rings(want)


def test_stop_token_and_max_tokens_inside_an_accepted_draft(routes):
    ref = _run(routes["cpp"], speculate="ngram", max_new_tokens=96)
    k = next(i for i, e in enumerate(ref.events) if e.speculated and i > 10)
    for kw in (dict(stop_token_ids=[ref.token_ids[k]]), dict(max_new_tokens=k + 1)):
        got = _run(routes["cpp"], speculate="ngram", **kw)
        want = _run(routes["py"], speculate="ngram", **kw)
        stop = ref.token_ids.index(ref.token_ids[k]) if "stop_token_ids" in kw else k
        assert got.token_ids == ref.token_ids[:stop + 1] == want.token_ids
        assert got.text == want.text


def test_bad_draft_requests_are_refused_by_name(routes, worker_bin):
    import grpc

    from dgr.wire.gen import stage_pb2_grpc as pb_grpc

    addresses = routes["cpp"]
    with RouteClient(addresses) as c:
        hops = route_hops(addresses, c.describe())
    ch = grpc.insecure_channel(addresses[0])
    try:
        stub = pb_grpc.StageStub(ch)
        for n, (source, k, want) in enumerate([("bogus", 4, "unknown draft source 'bogus'"), ("mtp", 4, "reserved for beta"),
                                               ("ngram", 17, "draft k must be in 1..16")]):
            sid = f"bad-{n}"
            assert not stub.OpenSession(pb.OpenSessionRequest(session_id=sid, epoch=1, route=hops)).HasField("error")
            frames = [pb.Frame(session_id=sid, epoch=1, generate=pb.Generate(max_new_tokens=4, draft_source=source,
                                                                             draft_k=k))]
            got = next(iter(stub.Frames(iter(frames), timeout=30)))
            assert got.error.code == pb.BAD_FRAME and want in got.error.message, got
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid, epoch=1, chain=True))
        # a client's own step may not carry drafts: those are the origin's
        sid = "bad-step"
        assert not stub.OpenSession(pb.OpenSessionRequest(session_id=sid, epoch=1, route=hops)).HasField("error")
        f = prefill_frame(sid, 1, [1, 2, 3], sample=True)
        f.step.drafts = 1
        got = next(iter(stub.Frames(iter([f]), timeout=30)))
        assert got.error.code == pb.BAD_FRAME and "origin's own steps" in got.error.message
        stub.CloseSession(pb.CloseSessionRequest(session_id=sid, epoch=1, chain=True))
    finally:
        ch.close()


def test_cli_speculate_gives_the_plain_text(routes):
    route = ",".join(routes["cpp"])
    prompt = "for i in range(10):\n    total += values[i]\n" * 3
    out = [subprocess.run([sys.executable, "-m", "dgr", "generate", "--route", route, "--max-tokens", "32",
                           "--ignore-eos", *extra, "--stats", prompt], capture_output=True, text=True, timeout=120)
           for extra in ([], ["--speculate", "ngram", "--draft-k", "6"])]
    assert out[0].returncode == 0 and out[1].returncode == 0, out[1].stderr
    assert out[1].stdout == out[0].stdout
    assert "speculation:" in out[1].stderr and "tokens per ring" in out[1].stderr
