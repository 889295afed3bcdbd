"""dgr-worker's speculative decoding (issue 21 phase 4, docs/worker.md): n-gram drafts at the origin
(worker/server/speculation/drafts.cpp, the port of dgr.runtime.wire.drafts), verified by the last stage in the
same ring, rejected drafts rolled back on every stage. A route of dgr-workers with speculation generates exactly
what it does without (tokens, text, bit-identical logits) and what the whole model does in process
(dgr.runtime.engine.Engine: greedy, or sampled with the engine library's own sampler, dgr_sample); a route cut
differently speculates alike; and its rings are the ones dgr.runtime.wire.drafts.NgramDrafts predicts on the
tokens generated (the same drafts, accepted at the same tokens).

Real processes on loopback, the real engine, a tiny synthetic bundle (3 stages; the same model in 2 stages).
"""

from __future__ import annotations

import ctypes as C
import subprocess
import sys

import numpy as np
import pytest

from dgr.runtime.wire.client import RouteClient
from dgr.runtime.wire.drafts import DEFAULT_DRAFT_K, NgramDrafts
from dgr.runtime.wire.gen import stage_pb2 as pb
from dgr.runtime.wire.stats import draft_stats, rings, tokens_per_ring

from support.engine import make_bundle, synth_model
from support.worker import cpp_stages, prefill_frame, route_hops

# a prompt that restates itself: prompt lookup finds what follows, and the tiny model's greedy loop too
PROMPT = [1] + [20, 21, 22, 23, 24, 25] * 6
MAX_NEW = 48
N_CTX = 256
FLAGS = ("--threads", "1", "--n-ctx", str(N_CTX))
SAMPLED = dict(temperature=0.9, top_k=40, top_p=0.95, seed=11)
CUTS = {"3": [(0, 2), (2, 4), (4, 6)], "2": [(0, 3), (3, 6)]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, engine_lib):
    """The whole model (a GGUF) and its bundles cut 3 ways and 2 ways."""
    d = tmp_path_factory.mktemp("cpp-speculate")
    src = synth_model(d, "llama", layers=6)
    return src, {k: make_bundle(src, r, d / f"store{k}").root for k, r in CUTS.items()}


def _start(bundle, n, worker_bin):
    return cpp_stages(worker_bin, bundle, n, *FLAGS)


@pytest.fixture(scope="module")
def routes(tiny, worker_bin):
    """The tiny model as a route of 3 dgr-workers ("cpp") and as one of 2 ("cut2")."""
    out = {}
    try:
        out["cpp"] = _start(tiny[1]["3"], 3, worker_bin)
        out["cut2"] = _start(tiny[1]["2"], 2, worker_bin)
        yield {k: [p.address for p in v] for k, v in out.items()}
    finally:
        for v in out.values():
            for p in v:
                print(p.stop()[-2000:])


def _run(addresses, **kw):
    kw.setdefault("max_new_tokens", MAX_NEW)
    kw.setdefault("stop_token_ids", [])
    with RouteClient(addresses) as c:
        return c.run(PROMPT, **kw)


def _same(a, b):
    assert a.token_ids == b.token_ids
    assert a.text == b.text
    assert sorted(a.logits) == sorted(b.logits)
    for p in a.logits:
        assert np.array_equal(a.logits[p], b.logits[p]), f"position {p}: max |diff| {np.max(np.abs(a.logits[p] - b.logits[p]))}"


def _whole(gguf, engine_lib, ids, max_new, temperature=0.0, top_k=0, top_p=0.0, seed=0):
    """The whole model in this process: each token drawn from the last row by the engine library's dgr_sample
    (greedy: its first maximum), keyed by the row's position as the last stage keys it. Tokens and rows."""
    from dgr.runtime.engine import Engine, load_library
    from dgr.runtime.engine_api import Step

    lib = load_library(engine_lib)
    lib.dgr_sample.argtypes = [C.POINTER(C.c_float), C.c_int32, C.c_double, C.c_int32, C.c_double, C.c_uint64,
                               C.c_int64]
    lib.dgr_sample.restype = C.c_int32
    eng = Engine.open(gguf, lib=engine_lib, n_threads=1)
    try:
        eng.open_session("whole", 1)
        r = eng.forward([Step("whole", 1, np.arange(len(ids), dtype=np.int32), np.asarray(ids, np.int32),
                              want_logits="last")])[0]
        out, rows, pos = [], [], len(ids) - 1
        while True:
            row = np.ascontiguousarray(r.logits[-1], dtype=np.float32).copy()
            rows.append(row)
            tok = lib.dgr_sample(row.ctypes.data_as(C.POINTER(C.c_float)), row.size, temperature, top_k, top_p,
                                 seed, pos)
            assert tok >= 0
            out.append(int(tok))
            if len(out) == max_new:
                return out, rows
            pos += 1
            r = eng.forward([Step("whole", 1, np.array([pos], np.int32), np.array([tok], np.int32),
                                  want_logits="last")])[0]
    finally:
        eng.close()


def _assert_whole(gen, ref):
    tokens, rows = ref
    assert gen.token_ids == tokens
    n = len(gen.prompt_ids)
    for k, row in enumerate(rows):
        assert np.array_equal(gen.logits[n - 1 + k], row), k


def _rings(gen):
    return [(e.token_id, e.speculated, e.drafted, e.accepted) for e in gen.events]


def _predicted_rings(prompt, tokens, max_new, draft_k=DEFAULT_DRAFT_K):
    """The rings the origin runs when the last stage's draws are `tokens` (dgr.runtime.wire.origin._next_step with
    dgr.runtime.wire.drafts.NgramDrafts): per token (token, speculated, drafted, accepted); the ring's accepted drafts
    come back as speculated tokens, then the token that closes it carries how many it drafted and accepted."""
    src, history = NgramDrafts(), list(prompt) + tokens[:1]
    out, produced = [(tokens[0], False, 0, 0)], 1              # the prefill's ring: no drafts
    while produced < min(max_new, len(tokens)):
        pos = len(history) - 1
        k = min(draft_k, max_new - produced - 1, N_CTX - 1 - pos)
        drafts = src.propose(history, k)[:k] if k > 0 else []
        acc = 0
        while acc < len(drafts) and produced + acc < len(tokens) and drafts[acc] == tokens[produced + acc]:
            acc += 1
        src.observe(len(drafts), acc)
        ring = tokens[produced:produced + acc + 1]
        out += [(t, True, 0, 0) for t in ring[:-1]] + [(ring[-1], False, len(drafts), acc)]
        history += ring
        produced += acc + 1
    return out


def _assert_rings_consistent(gen, max_new, draft_k=DEFAULT_DRAFT_K):
    """What a generation reports of its rings agrees with its tokens, and with the drafts NgramDrafts proposes."""
    drafted, accepted = draft_stats(gen)
    assert accepted == sum(e.speculated for e in gen.events)           # every accepted draft is one token
    assert len(gen.token_ids) == rings(gen) + accepted
    run = 0
    for e in gen.events:                                                 # a ring's drafts, then its token
        if e.speculated:
            assert (e.drafted, e.accepted) == (0, 0)
            run += 1
        else:
            assert e.accepted == run and e.accepted <= e.drafted <= draft_k, (e, run)
            run = 0
    assert _rings(gen) == _predicted_rings(gen.prompt_ids, gen.token_ids, max_new, draft_k)


@pytest.mark.parametrize("logits", ["last", "all"])
def test_speculative_greedy_equals_plain_and_the_whole_model(routes, tiny, engine_lib, logits):
    plain = _run(routes["cpp"], logits=logits)
    fast = _run(routes["cpp"], logits=logits, speculate="ngram")
    _same(fast, plain)                                # no rows of rejected drafts either
    assert len(fast.token_ids) == MAX_NEW
    n = len(fast.prompt_ids)
    assert sorted(fast.logits) == list(range(0 if logits == "all" else n - 1, n + MAX_NEW - 1))
    _assert_whole(fast, _whole(tiny[0], engine_lib, fast.prompt_ids, MAX_NEW))
    drafted, accepted = draft_stats(fast)
    assert drafted > 0 and accepted > 0 and tokens_per_ring(fast) > 1.0, (drafted, accepted)
    assert tokens_per_ring(plain) == 1.0 and draft_stats(plain) == (0, 0)
    assert not any(e.speculated for e in plain.events)
    _assert_rings_consistent(fast, MAX_NEW)           # the same drafts, accepted at the same tokens


def test_speculative_sampling_equals_plain_and_the_whole_model(routes, tiny, engine_lib):
    plain = _run(routes["cpp"], logits="last", **SAMPLED)
    fast = _run(routes["cpp"], logits="last", speculate="ngram", draft_k=6, **SAMPLED)
    _same(fast, plain)
    _assert_whole(fast, _whole(tiny[0], engine_lib, fast.prompt_ids, MAX_NEW, **SAMPLED))
    assert fast.token_ids != _run(routes["cpp"]).token_ids          # sampled, not greedy
    _assert_rings_consistent(fast, MAX_NEW, draft_k=6)


def test_a_route_cut_differently_speculates_alike(routes):
    for kw in (dict(logits="last"), dict(logits="last", draft_k=6, **SAMPLED)):
        want = _run(routes["cpp"], speculate="ngram", **kw)
        got = _run(routes["cut2"], speculate="ngram", **kw)
        _same(got, want)
        assert _rings(got) == _rings(want)
        _same(got, _run(routes["cut2"], **kw))                          # and what it does without


def test_stop_token_and_max_tokens_inside_an_accepted_draft(routes):
    ref = _run(routes["cpp"], speculate="ngram", max_new_tokens=96)
    k = next(i for i, e in enumerate(ref.events) if e.speculated and i > 10)
    for kw in (dict(stop_token_ids=[ref.token_ids[k]]), dict(max_new_tokens=k + 1)):
        got = _run(routes["cpp"], speculate="ngram", **kw)
        want = _run(routes["cpp"], **kw)                                # the same route without speculation
        stop = ref.token_ids.index(ref.token_ids[k]) if "stop_token_ids" in kw else k
        assert got.token_ids == ref.token_ids[:stop + 1] == want.token_ids
        assert got.text == want.text
        assert len(got.token_ids) == rings(got) + sum(e.speculated for e in got.events)
        if "max_new_tokens" in kw:                    # it caps the drafts: none run past it
            _assert_rings_consistent(got, k + 1)


def test_bad_draft_requests_are_refused_by_name(routes, worker_bin):
    import grpc

    from dgr.runtime.wire.gen import stage_pb2_grpc as pb_grpc

    addresses = routes["cpp"]
    with RouteClient(addresses) as c:
        hops = route_hops(addresses, c.describe())
    ch = grpc.insecure_channel(addresses[0])
    try:
        stub = pb_grpc.StageStub(ch)
        # the fake model has no MTP block: mtp is refused by name (ENGINE: the route cannot, not a bad frame)
        for n, (source, k, want) in enumerate([("bogus", 4, "unknown draft source 'bogus'"),
                                               ("mtp", 4, "has no MTP block"), ("ngram", 17, "draft k must be in 1..16")]):
            sid = f"bad-{n}"
            assert not stub.OpenSession(pb.OpenSessionRequest(session_id=sid, epoch=1, route=hops)).HasField("error")
            frames = [pb.Frame(session_id=sid, epoch=1, generate=pb.Generate(max_new_tokens=4, draft_source=source,
                                                                             draft_k=k))]
            got = next(iter(stub.Frames(iter(frames), timeout=30)))
            code = pb.ENGINE if source == "mtp" else pb.BAD_FRAME
            assert got.error.code == code and want in got.error.message, got
            assert source != "mtp" or "bundle.include_mtp" in got.error.message, got
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid, epoch=1, chain=True))
        # a client's own step may not carry drafts: those are the origin's
        sid = "bad-step"
        assert not stub.OpenSession(pb.OpenSessionRequest(session_id=sid, epoch=1, route=hops)).HasField("error")
        f = prefill_frame(sid, 1, [1, 2, 3], sample=True)
        f.step.drafts = 1
        got = next(iter(stub.Frames(iter([f]), timeout=30)))
        assert got.error.code == pb.BAD_FRAME and "origin's own steps" in got.error.message
        f.step.drafts, f.step.mtp_drafts = 0, 2       # nor ask for MTP drafts
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
