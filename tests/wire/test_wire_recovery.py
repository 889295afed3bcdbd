"""Recovery on real worker processes over loopback: a hop killed (-9), restarted in place or stopped
(SIGSTOP) at a seeded random decode step is routed around, and the text equals the uninterrupted run's."""

from __future__ import annotations

import random
import subprocess
import sys
import time

import pytest

from dgr.core.errors import WireError
from dgr.runtime.wire.client import RouteClient, parse_route
from dgr.runtime.wire.errors import HopUnreachable

from support.route import (MAX_NEW, PROMPT, SAMPLED, SPEC, die_at, fake_prompt_len, fake_route, reference,
                           restarted_when_dead, run_with_fault, stop_at)


def test_parse_route_replicas_and_errors():
    assert parse_route("a:1,b:2|b:3,c:4") == [["a:1"], ["b:2", "b:3"], ["c:4"]]
    assert parse_route(" a:1 , b:2 | b:2 ") == [["a:1"], ["b:2"]]
    for bad, what in [("a:1,,c:4", "stage 1 is empty"), ("a:1,b:2|,c:4", "stage 1 has an empty replica"),
                      ("", "the route is empty"), ("a:1,nohost", "'nohost' is not HOST:PORT")]:
        with pytest.raises(WireError, match=what):
            parse_route(bad)


@pytest.mark.parametrize("victim", [0, 1, 2])
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_kill_9_with_a_replica_resumes_to_the_same_text(victim, mode):
    kw = SAMPLED if mode == "sampled" else {}
    at = random.Random(f"{victim}{mode}").randint(2, 40)   # the decode step: random, fixed per test
    counts = [1, 1, 1]
    counts[victim] = 2
    # the victim's first replica kills itself right after token `at` of the session
    fault = die_at("victim", fake_prompt_len(), at)
    with fake_route(counts, extra=lambda i, k: fault if (i, k) == (victim, 0) else []) as r:
        want = reference(r, **kw)
        with RouteClient(r.replicas) as c:
            gen = c.run(PROMPT, max_new_tokens=MAX_NEW, stop_token_ids=[], session_id="victim", **kw)
        assert r.workers[victim][0].proc.wait(30) == -9    # it killed itself, not someone else
    assert gen.text == want.text and gen.token_ids == want.token_ids, at
    assert gen.epochs >= 2 and gen.failures[0].stage == victim, gen.failures
    assert gen.failures[0].address == r.replicas[victim][0]
    assert gen.routes[-1].split(",")[victim] == r.replicas[victim][1]


@pytest.mark.parametrize("kw", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_worker_restarted_in_place_resumes_to_the_same_text(kw):
    at = random.Random(7).randint(2, 40)
    fault = die_at("restarted", fake_prompt_len(), at)   # stage 1 kills itself right after token `at`
    with fake_route(extra=lambda i, k: fault if i == 1 else []) as r:   # no replica: the same address comes back empty
        want = reference(r, **kw)
        # its death restarts it; at token `at` the client waits for that, so it never finds the address empty
        with restarted_when_dead(r, 1) as back, RouteClient(r.addresses) as c:
            gen, _ = run_with_fault(c, lambda: back.result(30), at, session_id="restarted", **kw)
            assert back.result(30) == -9                # it killed itself, not someone else
        assert gen.text == want.text and gen.token_ids == want.token_ids
        assert gen.epochs >= 2 and {f.stage for f in gen.failures} == {1}
        assert gen.routes[-1] == r.route


def test_a_hop_dead_before_open_fails_over_during_prefill():
    with fake_route([1, 2, 1]) as r:
        want = reference(r)
        with RouteClient(r.replicas) as c:
            c.describe()                               # every hop answers ...
            r.kill(1)                                  # ... then stage 1's first replica dies
            gen = c.run("Once upon a time, the ring", max_new_tokens=160, stop_token_ids=[])
        assert gen.text == want.text
        assert gen.failures[0].stage == 1 and gen.failures[0].tokens == 0


def test_no_replica_left_names_every_hop_tried():
    at = random.Random(3).randint(2, 40)
    # the first replica dies right after token `at` (epoch 1), the second where it takes over (epoch 2)
    fault = {k: die_at("doomed", fake_prompt_len(), at, epoch=1 + k) for k in (0, 1)}
    with fake_route([1, 2, 1], extra=lambda i, k: fault[k] if i == 1 else []) as r:
        b1, b2 = r.replicas[1]
        with RouteClient(r.replicas, attempts=4) as c:
            with pytest.raises(HopUnreachable) as err:
                c.run(PROMPT, max_new_tokens=MAX_NEW, stop_token_ids=[], session_id="doomed")
    msg = str(err.value)
    assert "gave up after 4 failed attempt(s)" in msg
    assert f"stage 1 ({b1})" in msg and f"stage 1 ({b2})" in msg, msg
    assert len(err.value.failures) == 4 and {f.stage for f in err.value.failures} == {1}
    assert {f.address for f in err.value.failures} == {b1, b2}
    assert "--attempts" in msg


def test_a_stopped_middle_stage_is_routed_around_within_the_deadline():
    deadline = 1.0
    at = random.Random(5).randint(2, 40)
    # stage 1's first replica SIGSTOPs itself right after token `at` (hung there by construction)
    fault = stop_at("hung", fake_prompt_len(), at)
    with fake_route([1, 2, 1], extra=lambda i, k: fault if (i, k) == (1, 0) else []) as r:
        want = reference(r, **SAMPLED)
        seen = []                                       # when each token arrived
        with RouteClient(r.replicas, hop_deadline=deadline) as c:
            for _ in c.generate(PROMPT, max_new_tokens=MAX_NEW, stop_token_ids=[], session_id="hung", **SAMPLED):
                seen.append(time.monotonic())
            gen = c.last
        r.resume(1)
    assert gen.text == want.text and gen.token_ids == want.token_ids
    f = gen.failures[0]
    assert f.stage == 1 and f.code == "HOP_UNREACHABLE" and "hop deadline" in f.why, gen.failures
    assert at <= f.tokens < MAX_NEW                     # the hang came mid-generation, where it was placed
    detect = f.at - seen[f.tokens - 1]                  # from the last token before the silence
    print(f"\nSIGSTOPped stage 1 detected after {detect:.2f} s (hop deadline {deadline} s)")
    assert detect <= deadline * 3 + 1.0, detect


def test_route_source_supplies_a_replacement():
    fault = die_at("victim", fake_prompt_len(), 5)        # stage 1's first replica dies after token 5
    with fake_route([1, 2, 1], extra=lambda i, k: fault if (i, k) == (1, 0) else []) as r:
        b1, b2 = r.replicas[1]
        asked = []

        def source(stage, tried):
            asked.append((stage, list(tried)))
            return b2 if stage == 1 and b2 not in tried else None

        want = reference(r)
        with RouteClient([r.replicas[0], [b1], r.replicas[2]], route_source=source) as c:
            gen = c.run(PROMPT, max_new_tokens=MAX_NEW, stop_token_ids=[], session_id="victim")
        assert gen.text == want.text
        assert asked == [(1, [b1])] and gen.routes[-1].split(",")[1] == b2


def _middle_replica_killed(bundle, engine_lib, at: int, max_new: int, **kw):
    """A 3-stage route of `bundle` with two replicas of stage 1, the first killing itself (kill -9) right
    after generated token `at`: (the stages' descriptions, the uninterrupted run, the run recovered)."""
    from dgr.app.local import LocalRoute

    args = [["--bundle", str(bundle.root), "--stage", str(i), "--threads", "1", "--n-ctx", "256"]
            for i in range(3)]
    ids = list(range(5, 25))
    fault = die_at("victim", len(ids), at)
    with LocalRoute(args, replicas=[1, 2, 1], env={"DGR_ENGINE_LIB": str(engine_lib)}, timeout=300,
                    extra=lambda i, k: fault if (i, k) == (1, 0) else []) as r:
        with RouteClient(r.replicas) as c:
            hops = c.describe()
            want = c.run(ids, max_new_tokens=max_new, stop_token_ids=[], **kw)
        with RouteClient(r.replicas) as c:
            gen = c.run(ids, max_new_tokens=max_new, stop_token_ids=[], session_id="victim", **kw)
    return hops, want, gen


def _same_logits(gen, want) -> None:
    import numpy as np

    assert gen.token_ids == want.token_ids
    for p in want.logits:
        assert np.array_equal(gen.logits[p].view(np.uint32), want.logits[p].view(np.uint32)), f"position {p}"


@pytest.mark.engine
def test_real_engine_kill_of_a_middle_stage_resumes_to_the_same_text(tmp_path, engine_lib):
    from support.engine import make_bundle, synth_model

    bundle = make_bundle(synth_model(tmp_path, "llama"), [(0, 2), (2, 4), (4, 6)], tmp_path)
    _, want, gen = _middle_replica_killed(bundle, engine_lib, 9, 48, **SAMPLED)
    assert gen.token_ids == want.token_ids and gen.text == want.text
    assert gen.epochs >= 2 and gen.failures[0].stage == 1


def test_cli_route_with_replicas_and_a_bad_route():
    with fake_route([1, 2, 1]) as r:
        want = reference(r, max_new_tokens=24, stop_token_ids=None)
        r.kill(1)                                      # stage 1's first replica is dead from the start
        out = subprocess.run([sys.executable, "-m", "dgr", "generate", "--route", r.route, "--max-tokens", "24",
                              "--hop-deadline", "2", "--attempts", "3", PROMPT],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == want.text + "\n"
    bad = subprocess.run([sys.executable, "-m", "dgr", "generate", "--route", "127.0.0.1:1,,127.0.0.1:2", "x"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "stage 1 is empty" in bad.stderr and "Traceback" not in bad.stderr


def test_a_broken_stream_back_to_the_origin_is_recovered_not_waited_out():
    """The last stage's stream to a live origin breaks mid-generation (here: the last stage fails it right
    before a seeded random decode step, --test-break-origin-link-at; on a starved machine, a ping unanswered
    within the keepalive). The ring's token may be lost with it: the last stage says so on a new stream,
    and the client re-routes at once instead of waiting out its timeout; the text equals the uninterrupted
    run's."""
    at = random.Random(5).randint(2, 40)
    fault = ["--test-break-origin-link-at", f"victim:1:{fake_prompt_len() + at - 1}"]   # right after token `at`
    from dgr.app.local import FakeRoute

    with FakeRoute.of(SPEC, extra=lambda i, _: fault if i == 2 else []) as r:
        want = reference(r)
        with RouteClient(r.addresses, timeout=20) as c:
            gen = c.run(PROMPT, max_new_tokens=MAX_NEW, stop_token_ids=[], session_id="victim")
        log = "".join(r.logs[2])
    assert "--test-break-origin-link-at victim:1:" in log and "link failed" in log
    assert gen.text == want.text and gen.token_ids == want.token_ids
    assert gen.epochs >= 2, gen.failures
    assert gen.failures[0].code == "HOP_UNREACHABLE" and "lost its stream back to the origin" in gen.failures[0].why


def test_an_origin_restarted_in_place_serves_the_next_generation_at_once():
    """Stage 0 is killed mid-generation (the client moves to its replica), then restarted in place. The
    next generation, from a fresh client, starts there and the last stage must reach it on a new
    connection: gRPC shares one connection among a process's channels with the same target and
    arguments, and the last stage's new channel used to inherit the dead one's "connection refused"
    and its backoff (its token lost, the client waiting out its timeout; 9 runs of 12 here)."""
    rng = random.Random(17)
    ats = [rng.randint(2, 40) for _ in range(4)]
    # stage 0's first replica kills itself right after token ats[n] of session "origin-n" (its restarts keep
    # the flags): mid-generation by construction
    fault = [a for n, at in enumerate(ats) for a in die_at(f"origin-{n}", fake_prompt_len(), at)]
    with fake_route([2, 1, 1], extra=lambda i, k: fault if (i, k) == (0, 0) else []) as r:
        want = reference(r, **SAMPLED)
        for n in range(4):
            with RouteClient(r.replicas) as c:
                killed = c.run(PROMPT, max_new_tokens=MAX_NEW, stop_token_ids=[], session_id=f"origin-{n}", **SAMPLED)
            assert r.workers[0][0].proc.wait(30) == -9  # it killed itself mid-generation ...
            assert killed.epochs >= 2 and killed.failures[0].stage == 0, killed.failures   # ... and the client moved
            r.restart(0)
            with RouteClient(r.replicas, timeout=10) as c:
                gen = c.run(PROMPT, max_new_tokens=MAX_NEW, stop_token_ids=[], **SAMPLED)
            assert gen.text == want.text and gen.epochs == 1, gen.failures
            assert gen.routes == [",".join(r.addresses)]


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "IQ4_XS"])
def test_kill_9_on_k_and_i_quant_weights_resumes_to_the_same_tokens_and_logits(qtype, tmp_path, engine_lib):
    """The re-prefill after a kill -9 computes prompt + generated tokens as one batch; the tokens were
    first computed one decode step at a time. With weights in K- and I-quants (llama.cpp's own
    quantizer) both give the same logits bit for bit, so the text after the recovery point is the text
    of the uninterrupted run (before batch invariance, a Q4_K/Q6_K model's text changed here)."""
    from dgr.runtime.engine import quantize
    from dgr.toolchain.synth.generic import synth

    from support.engine import make_bundle

    model = quantize(synth("llama", 6, 256, 3, tmp_path / "f32.gguf"), tmp_path / f"{qtype}.gguf", qtype,
                     lib=engine_lib)
    bundle = make_bundle(model, [(0, 2), (2, 4), (4, 6)], tmp_path)
    hops, want, gen = _middle_replica_killed(bundle, engine_lib, 17, 96, logits="last")   # after token 17
    assert all(d.batch_invariant for d in hops)
    assert gen.epochs >= 2 and gen.failures[0].stage == 1
    assert len(want.logits) == 96
    _same_logits(gen, want)


@pytest.mark.engine
@pytest.mark.slow
def test_kill_9_on_a_route_that_is_not_batch_invariant_replays_the_history_as_first_computed(tmp_path, engine_lib):
    """minimax-01 is not batch invariant (docs/families.md): its workers say so, and the client's
    re-prefill after a kill -9 replays prompt and generated tokens the way they were first computed
    (the prompt as one chunk, each generated token as its own step), so tokens and logits still equal
    the uninterrupted run's bit for bit."""
    from dgr.toolchain.synth.parity import synth_model as synth_parity_model

    from support.engine import make_bundle

    bundle = make_bundle(synth_parity_model("minimax-01", tmp_path / "m.gguf"), [(0, 3), (3, 4), (4, 8)], tmp_path)
    hops, want, gen = _middle_replica_killed(bundle, engine_lib, 11, 32, logits="last")
    assert [d.batch_invariant for d in hops] == [False] * 3
    assert gen.epochs >= 2 and gen.failures[0].stage == 1
    _same_logits(gen, want)
