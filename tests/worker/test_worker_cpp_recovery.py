"""dgr-worker under failure (issue 21 phase 4, docs/worker.md): a stage killed (kill -9 at an exact step,
`--test-die-at`) or drained (SIGTERM, `--drain-timeout`) mid-generation; the Python client recovers to the
stage's replica and generates exactly what an uninterrupted run does (tokens, text, logits bit for bit).

Real processes on loopback, the real engine, the tiny synthetic bundle of tests/worker/test_worker_cpp_frames.py.
"""

from __future__ import annotations

import signal
import subprocess
import time

import grpc
import numpy as np
import pytest

from dgr.runtime.wire.client import RouteClient
from dgr.runtime.wire.errors import StageError
from dgr.runtime.wire.gen import stage_pb2 as pb, stage_pb2_grpc as pb_grpc

from support.wire import RawStream
from support.worker import FLAGS, SAMPLED, cpp, open_route, route_hops

PROMPT_IDS = list(range(5, 25))


def _route(bundle, worker_bin, victim_flags):
    """Stage 0, stage 1 twice (the first started with `victim_flags`), stage 2: every one a dgr-worker."""
    procs = []
    try:
        for stage, extra in ((0, ()), (1, victim_flags), (1, ()), (2, ())):
            procs.append(cpp(worker_bin, bundle, stage, *FLAGS, *extra))
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs


def _stop(procs):
    for p in procs:
        print(p.stop()[-2000:])


def _sigterm_mid_ring(p, timeout):
    """SIGTERM a stage the ring runs through: SIGSTOP first holds the ring at it (the next step cannot pass a
    stopped stage), so the drain starts with the generation unfinished, whatever the machine's speed; the
    SIGTERM stays pending until SIGCONT. (exit code, seconds from SIGCONT to exit)."""
    p.send_signal(signal.SIGSTOP)
    p.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    p.send_signal(signal.SIGCONT)
    rc = p.wait(timeout=timeout)
    return rc, time.monotonic() - t0


def _same(gen, want):
    assert gen.token_ids == want.token_ids
    assert gen.text == want.text
    assert sorted(gen.logits) == sorted(want.logits)
    for p in want.logits:
        assert np.array_equal(gen.logits[p].view(np.uint32), want.logits[p].view(np.uint32)), f"position {p}"


@pytest.mark.parametrize("at", [1, 9])
def test_kill_9_of_a_middle_stage_at_an_exact_step_recovers_to_the_same_text(tiny_route, worker_bin, at):
    max_new = 24
    victim_step = len(PROMPT_IDS) + at - 1                    # right after generated token `at`
    procs = _route(tiny_route[1], worker_bin, ("--test-die-at", f"victim:1:{victim_step}"))
    s0, a, b, s2 = procs
    replicas = [[s0.address], [a.address, b.address], [s2.address]]
    try:
        with RouteClient(replicas) as c:                      # another session's steps pass the victim untouched
            want = c.run(PROMPT_IDS, max_new_tokens=max_new, stop_token_ids=[], logits="last", **SAMPLED)
        assert a.p.poll() is None
        with RouteClient(replicas) as c:
            gen = c.run(PROMPT_IDS, max_new_tokens=max_new, stop_token_ids=[], logits="last", session_id="victim",
                        **SAMPLED)
        assert a.p.wait(timeout=30) == -signal.SIGKILL
        log = a.output()
        assert f"--test-die-at victim:1:{victim_step} reached: SIGKILL" in log, log[-2000:]
        _same(gen, want)
        assert len(gen.token_ids) == max_new
        assert gen.epochs >= 2 and gen.failures[0].stage == 1 and gen.failures[0].address == a.address
        assert gen.routes[-1].split(",")[1] == b.address
    finally:
        _stop(procs)


def test_bad_test_die_at_is_refused(tiny_route, worker_bin):
    for bad in ("victim", "victim:1", "victim:x:3", ":1:3", "victim:1:-3"):
        r = subprocess.run([str(worker_bin), "--bundle", str(tiny_route[1]), "--stage", "0", "--test-die-at", bad],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "give SESSION:EPOCH:POSITION" in r.stderr, (bad, r.stderr)


def test_sigterm_while_a_generation_streams_exits_within_the_bound_and_the_client_recovers(tiny_route, worker_bin):
    bound = 8.0                                      # a drain takes ~1 s; the margin is for a loaded machine
    max_new = 200
    procs = _route(tiny_route[1], worker_bin, ("--drain-timeout", str(bound)))
    s0, a, b, s2 = procs
    replicas = [[s0.address], [a.address, b.address], [s2.address]]
    try:
        with RouteClient([s0.address, b.address, s2.address]) as c:
            want = c.run(PROMPT_IDS, max_new_tokens=max_new, stop_token_ids=[], logits="last")
            hops = route_hops([s0.address, a.address, s2.address], c.describe())
        # what the drain must not wait for: abandoned sessions through the victim, a stream into it left open
        # after a malformed frame, and one that never sends anything
        ch = grpc.insecure_channel(s0.address)
        stub = pb_grpc.StageStub(ch)
        for i in range(3):
            assert not open_route(stub, hops, f"gone-{i}").HasField("error")
        bad = RawStream(a.address)
        assert bad.ask(pb.Frame(session_id="gone-0", epoch=1, step=pb.Step(positions=[0, 2]))).HasField("error")
        idle = RawStream(a.address)
        took = None
        with RouteClient(replicas, timeout=30) as c:
            for k, _ in enumerate(c.generate(PROMPT_IDS, max_new_tokens=max_new, stop_token_ids=[], logits="last")):
                if k == 2:                                    # the ring runs through `a` right now
                    rc, took = _sigterm_mid_ring(a.p, bound + 30)   # generous: the watchdog holds the bound
            gen = c.last
        log = a.output()
        print(f"SIGTERM to exit: {took:.2f} s (bound {bound} s)")
        assert rc == 0 and "drained and stopped" in log, log[-2000:]
        assert took <= bound + 1.0, log[-2000:]
        _same(gen, want)                                      # recovered to the replica: nothing lost, nothing changed
        assert gen.failures, "the drain came after the generation ended"
        if gen.failures:
            assert gen.failures[0].stage == 1 and "shutting down" in gen.failures[0].why
            assert gen.routes[-1].split(",")[1] == b.address
        for x in (bad, idle):
            x.close()
        ch.close()
    finally:
        _stop(procs)


def test_sigterm_with_no_replica_gives_the_client_a_clear_error(tiny_route, worker_bin):
    procs = [cpp(worker_bin, tiny_route[1], i, *FLAGS, "--drain-timeout", "8") for i in range(3)]
    try:
        with RouteClient([p.address for p in procs], timeout=30, attempts=1) as c:
            with pytest.raises(StageError) as e:
                for k, _ in enumerate(c.generate(PROMPT_IDS, max_new_tokens=200, stop_token_ids=[])):
                    if k == 2:
                        assert _sigterm_mid_ring(procs[1].p, 30)[0] == 0
        assert procs[1].address in str(e.value), str(e.value)
    finally:
        _stop(procs)


def test_kill_9_mid_speculation_recovers_to_the_same_text(tiny_route, worker_bin):
    prompt = [1] + [20, 21, 22, 23, 24, 25] * 4                # restates itself: the origin drafts
    max_new, at = 40, 12
    victim_step = len(prompt) + at - 1                        # a speculative step holds it (drafts or not)
    procs = _route(tiny_route[1], worker_bin, ("--test-die-at", f"spec-victim:1:{victim_step}"))
    s0, a, b, s2 = procs
    replicas = [[s0.address], [a.address, b.address], [s2.address]]
    try:
        with RouteClient([s0.address, b.address, s2.address]) as c:
            want = c.run(prompt, max_new_tokens=max_new, stop_token_ids=[], logits="last")
        with RouteClient(replicas) as c:
            gen = c.run(prompt, max_new_tokens=max_new, stop_token_ids=[], logits="last", session_id="spec-victim",
                        speculate="ngram")
        assert a.p.wait(timeout=30) == -signal.SIGKILL
        _same(gen, want)
        assert sum(e.drafted for e in gen.events) > 0 and gen.failures[0].stage == 1
    finally:
        _stop(procs)
