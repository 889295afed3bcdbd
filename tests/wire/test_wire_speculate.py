"""Speculative decoding over the ring: n-gram drafts from the origin, verified by the last stage in the same
trip, rejected positions rolled back on every stage. The text must equal the non-speculative one token for
token (fake engine: logits too, bit for bit), on fake-model dgr-workers, worker processes and the real engine
(SmolLM2 and a tiny llama); recurrent models are refused with a clear error."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from dgr.app.local import FakeRoute, LocalRoute
from dgr.core.errors import WireError
from dgr.runtime.wire.client import RouteClient
from dgr.runtime.wire.drafts import NgramDrafts, check_source, make_source
from dgr.runtime.wire.errors import RemoteEngineError
from dgr.runtime.wire.gen import stage_pb2 as pb
from dgr.runtime.wire.stats import draft_stats, tokens_per_ring

from support.route import SAMPLED, die_at, fake_prompt_len, fake_route
from support.wire import RawStream

SPEC = "layers=6,embd=16,cuts=2:4,hash_layers=3,seed=8"
# text that restates itself: prompt lookup finds what follows, and the fake model's greedy loop too
PROMPT = "for i in range(10):\n    total += values[i]\n" * 4


def _both(client, prompt=PROMPT, **kw):
    kw.setdefault("max_new_tokens", 96)
    kw.setdefault("stop_token_ids", [])
    plain = client.run(prompt, **kw)
    spec = client.run(prompt, speculate="ngram", **kw)
    return plain, spec


def test_ngram_drafts_propose_what_followed_the_last_match_and_back_off():
    d = NgramDrafts()
    h = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    assert d.propose(h, 4) == [4, 5, 9, 9]            # the longest earlier match of the suffix, then k tokens
    assert d.propose(h + [7, 8], 4) == []             # nothing to match: a plain step
    d, h = NgramDrafts(), [1, 2, 3, 4, 5, 1, 2]
    assert d.propose(h, 3) == [3, 4, 5]
    d.observe(3, 0)
    d.observe(3, 0)                                   # two misses in a row: only a 4-gram match drafts now
    assert d.propose(h, 3) == []
    d.observe(3, 1)                                   # (an accepted draft resets that)
    assert d.propose(h, 3) == [3, 4, 5]
    d = NgramDrafts()
    h = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4]
    for _ in range(3):                                # misses even with the longest (4-gram) match...
        d.observe(4, 0)
    assert [d.propose(h, 4) for _ in range(3)] == [[], [], [5, 6, 1, 2]]   # ...pause 2 plain steps
    d.observe(4, 0)
    assert [d.propose(h, 4) for _ in range(5)] == [[], [], [], [], [5, 6, 1, 2]]   # then 4
    d.observe(4, 2)                                   # an accepted draft ends the pause
    assert d.propose(h, 4) == [5, 6, 1, 2]
    assert check_source("mtp") == "mtp"              # the origin's: drafts from the last stage's MTP block
    with pytest.raises(WireError, match="runs on the route's last stage"):
        make_source("mtp")
    with pytest.raises(WireError, match="unknown draft source"):
        check_source("eagle")
    with pytest.raises(WireError, match="unknown draft source"):
        make_source("eagle")


@pytest.mark.parametrize("stages", ["cuts=3", "cuts=2:4", "cuts=1:2:4"])
def test_speculative_greedy_equals_plain_bit_for_bit(stages):
    spec = SPEC.replace("cuts=2:4", stages)
    with FakeRoute.of(spec) as route, RouteClient(route.addresses) as c:
        plain, fast = _both(c, logits="last")
    assert fast.token_ids == plain.token_ids and fast.text == plain.text
    assert sorted(fast.logits) == sorted(plain.logits)
    assert all(np.array_equal(fast.logits[p], plain.logits[p]) for p in plain.logits)
    drafted, accepted = draft_stats(fast)
    assert accepted > 0 and tokens_per_ring(fast) > 1.5, (drafted, accepted, tokens_per_ring(fast))
    assert tokens_per_ring(plain) == 1.0 and draft_stats(plain) == (0, 0)
    assert [e.position for e in fast.events] == [e.position for e in plain.events]


def test_speculative_sampling_and_all_logits_equal_plain():
    with FakeRoute.of(SPEC) as route, RouteClient(route.addresses) as c:
        plain, fast = _both(c, **SAMPLED)               # each draw keyed by (seed, position): same text
        assert fast.token_ids == plain.token_ids and fast.text == plain.text
        plain, fast = _both(c, logits="all", max_new_tokens=40)
    assert fast.token_ids == plain.token_ids
    assert sorted(fast.logits) == sorted(plain.logits)  # no rows of rejected drafts
    assert all(np.array_equal(fast.logits[p], plain.logits[p]) for p in plain.logits)


def test_stop_token_and_max_tokens_inside_an_accepted_draft():
    with FakeRoute.of(SPEC) as route, RouteClient(route.addresses) as c:
        ref = c.run(PROMPT, max_new_tokens=96, stop_token_ids=[], speculate="ngram")
        # a token the speculative run got as an accepted draft: stopping there must cut the ring short
        k = next(i for i, e in enumerate(ref.events) if e.speculated and i > 10)
        stop = ref.token_ids[k]
        plain, fast = _both(c, stop_token_ids=[stop])
        assert fast.token_ids == plain.token_ids and fast.token_ids[-1] == stop
        for n in (k, k + 1, k + 2):
            plain, fast = _both(c, max_new_tokens=n)
            assert fast.token_ids == plain.token_ids and len(fast.token_ids) == n


def test_worker_processes_and_the_cli_give_the_plain_text():
    with fake_route() as r:
        with RouteClient(r.addresses) as c:
            plain, fast = _both(c)
            assert fast.text == plain.text and tokens_per_ring(fast) > 1.5
            d = c.describe()
            assert all(h.can_roll_back for h in d)
            assert sum(h.cached_positions for h in d) == 0   # closed sessions leave nothing behind
        out = [subprocess.run([sys.executable, "-m", "dgr", "generate", "--route", r.route, "--max-tokens", "48",
                               *extra, "--stats", PROMPT], capture_output=True, text=True, timeout=60)
               for extra in ([], ["--speculate", "ngram", "--draft-k", "6"])]
    assert out[0].returncode == 0 and out[1].returncode == 0, out[1].stderr
    assert out[1].stdout == out[0].stdout
    assert "speculation:" in out[1].stderr and "tokens per ring" in out[1].stderr


def test_a_killed_stage_mid_speculation_recovers_to_the_same_text():
    # stage 1's first replica kills itself about to run the step holding the 30th token's position: mid-
    # generation by construction (a speculative step holding that position counts too)
    fault = die_at("victim", fake_prompt_len(PROMPT), 30)
    with fake_route(replicas=[1, 2, 1], extra=lambda i, k: fault if (i, k) == (1, 0) else []) as r, \
            RouteClient(r.replicas) as c:
        want = c.run(PROMPT, max_new_tokens=120, stop_token_ids=[]).token_ids
        gen = c.run(PROMPT, max_new_tokens=120, stop_token_ids=[], speculate="ngram", session_id="victim")
        assert r.workers[1][0].proc.wait(30) == -9          # it killed itself, not someone else
    assert gen.token_ids == want and gen.epochs == 2 and gen.failures[0].stage == 1


def test_rollback_only_drops_rejected_drafts():
    """A step flagged `rollback` that would drop positions no speculative step put there is a CACHE_MISS."""
    with FakeRoute.of(SPEC) as route, RouteClient(route.addresses) as c:
        c.run("warm", max_new_tokens=2)
        hops = c.hops
        sid = "raw-rollback"
        reply = c._stub(route.addresses[0]).OpenSession(pb.OpenSessionRequest(
            session_id=sid, epoch=1, hop_index=0, route=[
                pb.Hop(address=a, bundle_id=d.identity.bundle_id, stage_index=d.identity.stage_index,
                       layer_begin=d.identity.layer_begin, layer_end=d.identity.layer_end)
                for a, d in zip(route.addresses, hops)]), timeout=10)
        assert not reply.HasField("error")
        s = RawStream(route.addresses[0])
        try:
            bad = s.ask(pb.Frame(session_id=sid, epoch=1, step=pb.Step(
                positions=[0, 1, 2], token_ids=[1, 5, 6], cache_expect=0, sample=True, drafts=2)))
            assert bad.error.code == pb.BAD_FRAME and "origin's own" in bad.error.message
            s.ask(pb.Frame(session_id=sid, epoch=1, generate=pb.Generate(max_new_tokens=1)), expect_reply=False)
            tok = s.ask(pb.Frame(session_id=sid, epoch=1, step=pb.Step(
                positions=range(6), token_ids=[1, 5, 6, 7, 8, 9], cache_expect=0, sample=True)))
            assert tok.HasField("token") and tok.token.done
        finally:
            s.close()
        # stage 1 now holds 6 positions, none of them drafts: a rollback to 3 is refused there
        s = RawStream(route.addresses[1])
        try:
            from dgr.runtime.wire import codec

            d1 = hops[1]
            x = np.zeros((1, d1.schema_in.n_streams, d1.schema_in.n_embd), np.float32)
            err = s.ask(pb.Frame(session_id=sid, epoch=1, step=pb.Step(
                positions=[3], token_ids=[5], cache_expect=3, sample=False, rollback=True,
                boundary=codec.encode(x, d1.schema_in.dtype), schema=d1.schema_in)))
        finally:
            s.close()
    assert err.error.code == pb.CACHE_MISS and err.error.held == 6 and err.error.expected == 3


def test_recurrent_models_refuse_speculation_clearly():
    spec = SPEC + ",recurrent=1"
    with FakeRoute.of(spec) as route, RouteClient(route.addresses) as c:
        assert c.run(PROMPT, max_new_tokens=8).token_ids              # plain decoding still works
        with pytest.raises(WireError, match=r"stage 0 \(.*\) \(fake\).*cannot roll back.*without --speculate"):
            c.run(PROMPT, max_new_tokens=8, speculate="ngram")
        c._check_speculation = lambda *a: None                        # a client that does not check first:
        with pytest.raises(RemoteEngineError, match="cannot .*generate without --speculate"):
            c.run(PROMPT, max_new_tokens=8, speculate="ngram")        # the origin refuses it too


# ---------------------------------------------------------------------------------------------- real engine
def _engine_route(engine_lib, root, stages):
    # one compute thread per worker: ggml's threads spin while waiting, and workers share the cores here
    return LocalRoute([["--bundle", str(root), "--stage", str(i), "--threads", "1", "--n-ctx", "512"]
                       for i in range(stages)], env={"DGR_ENGINE_LIB": str(engine_lib)}, timeout=300)


@pytest.mark.engine
@pytest.mark.slow
def test_smollm2_over_three_worker_processes_speculative_equals_plain(engine_lib):
    from dgr.app.demo import ensure_bundle
    from dgr.app.bench.speculate_ngram import WORKLOADS

    b = ensure_bundle(3, progress=False)[0]
    with _engine_route(engine_lib, b.root, 3) as r, RouteClient(r.addresses) as c:
        runs = {name: _both(c, prompt, max_new_tokens=64, logits="last") for name, prompt in WORKLOADS.items()}
    for name, (plain, fast) in runs.items():
        # a verification step of k+1 positions gives every row bit for bit as one-position steps do (batch
        # invariance), so the tokens and the logits equal the plain run's
        worst = max(float(np.max(np.abs(fast.logits[p] - plain.logits[p]))) for p in plain.logits)
        print(f"\n{name}: {tokens_per_ring(fast):.2f} tokens/ring, drafts {draft_stats(fast)}, max |logit diff| {worst:.2e}")
        assert fast.token_ids == plain.token_ids and fast.text == plain.text, name
        assert worst == 0.0, name
    # drafts pay on text that repeats its context: more tokens per ring than on text that does not (how
    # many more depends on the text, which depends on the build's rounding: 2.17 with the CMake engine,
    # 1.47 with Bazel's -march=x86-64-v3 one on 2026-12-01)
    assert draft_stats(runs["repetitive"][1])[1] > 0
    assert tokens_per_ring(runs["repetitive"][1]) > tokens_per_ring(runs["plain"][1])
    # the speculative run restored the plain run's prompt from the prefix caches: its drafts still look up the
    # restored positions (Generate.cached_ids), which no step carried
    assert runs["repetitive"][1].cached_tokens > 0, [fast.cached_tokens for _, fast in runs.values()]


@pytest.mark.engine
@pytest.mark.slow
def test_tiny_llama_split_three_ways_speculative_equals_plain(engine_lib, tmp_path):
    from support.engine import make_bundle, synth_model

    b = make_bundle(synth_model(tmp_path, "llama"), [(0, 2), (2, 4), (4, 6)], tmp_path / "store")
    prompt = [1] + [20, 21, 22, 23, 24, 25] * 6
    with _engine_route(engine_lib, b.root, 3) as r, RouteClient(r.addresses) as c:
        plain, fast = _both(c, prompt, max_new_tokens=48)
        sampled = _both(c, prompt, max_new_tokens=48, **SAMPLED)
    assert fast.token_ids == plain.token_ids
    assert sampled[1].token_ids == sampled[0].token_ids
    assert draft_stats(fast)[0] > 0                   # the repeated prompt made the origin draft


@pytest.mark.engine
def test_engine_truncate_drops_positions_and_recurrent_models_refuse(engine_lib, tmp_path):
    from dgr.core.errors import EngineError
    from dgr.runtime.engine import Engine
    from dgr.runtime.engine_api import Step

    from support.engine import synth_model

    ids = np.array([1, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40], np.int32)

    def step(eng, sid, lo, hi, toks=None):
        t = ids[lo:hi] if toks is None else np.asarray(toks, np.int32)
        return eng.forward([Step(sid, 1, np.arange(lo, hi, dtype=np.int32), token_ids=t, want_logits="last")])[0]

    with Engine.open(synth_model(tmp_path, "llama"), lib=engine_lib, n_threads=1, n_ctx=64) as eng:
        assert eng.describe().can_truncate
        for sid in ("spec", "plain"):
            eng.open_session(sid, 1)
            step(eng, sid, 0, 8)
        step(eng, "spec", 8, 12, [37, 38, 90, 91])    # the last two positions: rejected drafts
        eng.truncate("spec", 1, 10)
        assert eng.n_cached("spec", 1) == 10
        with pytest.raises(EngineError, match="cannot keep 11"):
            eng.truncate("spec", 1, 11)
        # the same history without the drafts (after the truncation, so both sessions' cells line up alike:
        # llama.cpp's sums depend on where a session's cells lie in the shared cache)
        step(eng, "plain", 8, 10)
        a, b = step(eng, "spec", 10, 11, [7]), step(eng, "plain", 10, 11, [7])
        assert a.n_cached == b.n_cached == 11 and a.next_token == b.next_token
        np.testing.assert_allclose(a.logits, b.logits, atol=1e-5)
    with Engine.open(synth_model(tmp_path, "mamba"), lib=engine_lib, n_threads=1, n_ctx=64) as eng:
        assert not eng.describe().can_truncate
        eng.open_session("s", 1)
        step(eng, "s", 0, 6)
        eng.truncate("s", 1, 6)                       # nothing to drop: fine
        with pytest.raises(EngineError, match="recurrent or hybrid.*without --speculate"):
            eng.truncate("s", 1, 4)
