"""dgr-worker's trust and bounds (issue 21 phase 3, docs/worker.md): TLS and mutual TLS on the listener and
on every link, the peer checks of a session's frames under mutual TLS, the connection bound, a peer that
stops reading, and a wildcard listener that advertises a reachable address.

Real dgr-worker processes on loopback, real certificates from `dgr certs` (tmp), the real engine on a tiny
synthetic bundle split in 3 stages. Situations are forced, never timed: raw streams that never read, a
bound of 2 connections filled by hand, an intruder's hand-made frames.
"""

from __future__ import annotations

import json
import queue
import socket
import threading
import time

import grpc
import numpy as np
import pytest

from dgr.runtime.wire import codec, tls as wtls
from dgr.runtime.wire.client import RouteClient
from dgr.runtime.wire.errors import HopUnreachable
from dgr.runtime.wire.gen import stage_pb2 as pb, stage_pb2_grpc as pb_grpc

from support.worker import cpp, cpp_stages, make_ca, one_line_error, prefill_frame, route_hops, tls_flags, wait_for

FLAGS = ("--threads", "1", "--n-ctx", "512")
PROMPT_IDS = [5, 9, 2, 7, 11, 3, 8]
MAX_NEW = 10


@pytest.fixture(scope="module")
def tiny(tiny_route):
    return tiny_route[1]                            # 6 llama layers in 3 stages (tests/conftest.py)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    good = make_ca(d / "ops", ["w0", "w1", "w2", "client", "intruder"])
    other = make_ca(d / "other", ["stranger"])
    return good, other


def _start(bundle, worker_bin, per_stage):
    return cpp_stages(worker_bin, bundle, 3, *FLAGS, per_stage=per_stage)


@pytest.fixture(scope="module")
def mtls(tiny, worker_bin, pki):
    good, _ = pki
    procs = _start(tiny, worker_bin, lambda i: tls_flags(good[f"w{i}"]))
    try:
        yield [p.address for p in procs], procs
    finally:
        for p in procs:
            print(p.stop()[-3000:])


@pytest.fixture(scope="module")
def plain(tiny, worker_bin):
    procs = _start(tiny, worker_bin, lambda i: ())
    try:
        yield [p.address for p in procs], procs
    finally:
        for p in procs:
            p.stop()


def _stub(address, tls=None, **opts):
    options = [("grpc.use_local_subchannel_pool", 1), *opts.items()]
    ch = (grpc.secure_channel(address, tls.channel_credentials(), options=options) if tls
          else grpc.insecure_channel(address, options=options))
    return ch, pb_grpc.StageStub(ch)


class Raw:
    """A raw Frames stream (its own connection): send hand-made frames, read the replies, or never read."""

    def __init__(self, address, tls=None, read=True, **opts):
        self.channel, stub = _stub(address, tls, **opts)
        self.q, self.replies, self.error = queue.Queue(), queue.Queue(), None
        self.call = stub.Frames(iter(self.q.get, None))
        if read:
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        try:
            for f in self.call:
                self.replies.put(f)
        except grpc.RpcError as err:
            self.error = err
        self.replies.put(None)

    def ask(self, frame, timeout=20):
        self.q.put(frame)
        return self.replies.get(timeout=timeout)

    def close(self):
        self.q.put(None)
        self.call.cancel()
        self.channel.close()


def _reference(addresses, tls=None, **kw):
    with RouteClient(addresses, tls=tls) as c:
        return c.run(PROMPT_IDS, max_new_tokens=MAX_NEW, stop_token_ids=[], **kw)


# ---------------------------------------------------------------------------------------------- TLS

def test_tls_and_mutual_tls_describe_as_the_python_worker(tiny, worker_bin, pki, mtls):
    good, _ = pki
    server_only = wtls.TlsConfig(good["w0"].cert, good["w0"].key)
    p = cpp(worker_bin, tiny, 0, *FLAGS, *tls_flags(server_only, mutual=False))
    try:
        assert "TLS serving on" in "".join(p.log) and "mutual TLS" not in "".join(p.log)
        ch, s = _stub(p.address, good["client"])
        with ch:
            d = s.Describe(pb.DescribeRequest(), timeout=10)
        assert d.tls and not d.mutual_tls and d.member == "w0"
        assert json.loads(d.descriptor_json)["security"] == {"tls": True, "mutual_tls": False, "member": "w0"}
        ch, s = _stub(p.address)                                     # plaintext to a TLS listener
        with ch, pytest.raises(grpc.RpcError) as err:
            s.Describe(pb.DescribeRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        p.stop()
    addresses, procs = mtls
    assert all("mutual TLS serving on" in "".join(q.log) for q in procs)
    for i, a in enumerate(addresses):
        ch, s = _stub(a, good["client"])
        with ch:
            d = s.Describe(pb.DescribeRequest(), timeout=10)
        assert d.tls and d.mutual_tls and d.member == f"w{i}"
        assert json.loads(d.descriptor_json)["security"] == {"tls": True, "mutual_tls": True, "member": f"w{i}"}


def test_mtls_route_generates_what_a_plaintext_route_does(mtls, plain, pki):
    """Every link (stage to stage, last stage to the origin) runs mutual TLS with the worker's certificate:
    a stage without it would be refused by the next one."""
    good, _ = pki
    for kw in ({}, dict(temperature=0.9, top_k=40, top_p=0.95, seed=11)):
        want = _reference(plain[0], **kw)
        got = _reference(mtls[0], tls=good["client"], **kw)
        assert got.token_ids == want.token_ids and got.text == want.text


@pytest.mark.parametrize("who", ["no certificate", "plaintext", "another CA"])
def test_mtls_refuses_a_client_without_a_certificate(mtls, pki, who):
    good, other = pki
    addresses, _ = mtls
    if who == "no certificate":                      # TLS, trusting the worker, but presenting nothing
        ch = grpc.secure_channel(addresses[1], grpc.ssl_channel_credentials(root_certificates=good["client"].ca.read_bytes()))
        with ch, pytest.raises(grpc.RpcError) as err:
            pb_grpc.StageStub(ch).Describe(pb.DescribeRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        return
    tls = None if who == "plaintext" else wtls.TlsConfig(other["stranger"].cert, other["stranger"].key, good["client"].ca)
    with RouteClient(addresses, tls=tls) as c, pytest.raises(HopUnreachable) as err:
        c.run(PROMPT_IDS, max_new_tokens=2)
    assert "TLS refused" in str(err.value), str(err.value)


# ------------------------------------------------------------------------------------- peer checks

def test_a_member_that_did_not_open_a_session_can_neither_step_feed_nor_redirect_it(mtls, pki):
    good, _ = pki
    addresses, procs = mtls
    want = _reference(addresses, tls=good["client"])
    descs = []
    for a in addresses:
        ch, s = _stub(a, good["client"])
        with ch:
            descs.append(s.Describe(pb.DescribeRequest(), timeout=10))
    ch, s0 = _stub(addresses[0], good["client"])
    with ch:
        assert not s0.OpenSession(pb.OpenSessionRequest(session_id="own", epoch=1, route=route_hops(addresses, descs)),
                                  timeout=30).HasField("error")
    intruder = [Raw(a, good["intruder"]) for a in addresses]
    try:
        # step it at stage 1 (as if it were stage 0)
        step = pb.Frame(session_id="own", epoch=1, step=pb.Step(
            positions=range(3), token_ids=[3, 4, 5], cache_expect=0, schema=descs[1].schema_in,
            boundary=codec.encode(np.zeros((3, 1, descs[1].schema_in.n_embd), np.float32), pb.F32)))
        # under mutual TLS the id names a session only in its opener's namespace (docs/security.md): to
        # another member it names nothing, at any stage
        r = intruder[1].ask(step)
        assert r.error.code == pb.UNKNOWN_SESSION, r
        assert "no open session own epoch 1: open it (OpenSession) first" in r.error.message
        # step it at stage 0 (as if it were the client)
        r = intruder[0].ask(prefill_frame("own", 1, [1, 2, 3], sample=True))
        assert r.error.code == pb.UNKNOWN_SESSION, r
        # redirect its replies: a Generate frame would make this stream the session's client
        r = intruder[0].ask(pb.Frame(session_id="own", epoch=1, generate=pb.Generate(max_new_tokens=5)))
        assert r.error.code == pb.UNKNOWN_SESSION, r
        # feed its origin tokens: the route's hops name it by an id stage 0 drew, unknown to the intruder
        r = intruder[0].ask(pb.Frame(session_id="own", epoch=1, token=pb.Token(token_id=1, position=0)))
        assert r.error.code == pb.UNKNOWN_SESSION
        assert "no open session own epoch 1 returns here" in r.error.message
        # an error frame is dropped without a word (it would fail the session)
        intruder[0].q.put(pb.Frame(session_id="own", epoch=1, error=pb.WireError(code=pb.ENGINE, message="forged")))
        # close it at stage 0 and 1: names nothing of the owner's
        for a in addresses[:2]:
            ch, s = _stub(a, good["intruder"])
            with ch:
                assert not s.CloseSession(pb.CloseSessionRequest(session_id="own", epoch=1, chain=True),
                                          timeout=10).HasField("error")
    finally:
        for x in intruder:
            x.close()
    # the owner's generation is unharmed: the same tokens as a fresh route run
    owner = Raw(addresses[0], good["client"])
    try:
        owner.q.put(pb.Frame(session_id="own", epoch=1, generate=pb.Generate(max_new_tokens=MAX_NEW)))
        owner.q.put(prefill_frame("own", 1, PROMPT_IDS, sample=True))
        got = []
        while True:
            f = owner.replies.get(timeout=60)
            assert f is not None and not f.HasField("error"), (f, owner.error)
            if f.HasField("token"):
                got.append(f.token.token_id)
                if f.token.done:
                    break
        assert got == want.token_ids
    finally:
        owner.close()


# ------------------------------------------------------------------------------------------ bounds

def test_a_flood_of_connections_is_refused_beyond_the_bound(tiny, worker_bin):
    procs = _start(tiny, worker_bin, lambda i: ("--max-connections", "3") if i == 0 else ())
    addresses = [p.address for p in procs]
    flood = []
    try:
        probe = pb.Frame(session_id="nobody", epoch=1, step=pb.Step(positions=[0], token_ids=[1]))
        for _ in range(3):                           # each its own connection, each admitted (it answers)
            flood.append(Raw(addresses[0]))
            assert flood[-1].ask(probe).error.code == pb.UNKNOWN_SESSION
        extra = Raw(addresses[0])
        flood.append(extra)
        assert extra.replies.get(timeout=20) is None
        assert extra.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "3 connections have calls in progress (--max-connections 3)" in extra.error.details()
        assert procs[0].stub.Describe(pb.DescribeRequest(), timeout=10).overloaded >= 1   # unary calls still served
        for x in flood:
            x.close()
        flood.clear()
        # the flood gone, a route through the worker works (the client and the last stage: 2 connections)
        want = _reference([p.address for p in procs])
        assert len(want.token_ids) == MAX_NEW
    finally:
        for x in flood:
            x.close()
        for p in procs:
            p.stop()


def test_connections_that_never_finish_a_handshake_are_closed_and_members_are_served_meanwhile(tiny, worker_bin, pki, mtls):
    """A flood of bare TCP connections to a mutual-TLS stage that never send a ClientHello (a scanner, a
    stranger holding the worker's descriptors): a member's route through it is served while they wait, and
    the worker closes every one of them itself after --handshake-timeout (gRPC's own default is 120 s)."""
    good, _ = pki
    addresses, _ = mtls
    want = _reference(addresses, tls=good["client"])
    p = cpp(worker_bin, tiny, 1, *FLAGS, *tls_flags(good["w1"]), "--handshake-timeout", "1")
    idle = []
    try:
        host, port = p.address.rsplit(":", 1)
        idle = [socket.create_connection((host, int(port)), timeout=60) for _ in range(200)]
        got = _reference([addresses[0], p.address, addresses[2]], tls=good["client"])
        assert got.token_ids == want.token_ids and got.text == want.text
        for c in idle:                               # EOF from the worker (a socket.timeout here: never closed)
            assert c.recv(4096) == b""
        ch, stub = _stub(p.address, good["client"])  # and it still serves
        with ch:
            assert stub.Describe(pb.DescribeRequest(), timeout=10).identity.stage_index == 1
    finally:
        for c in idle:
            c.close()
        p.stop()
    rc, line = one_line_error([str(worker_bin), "--bundle", str(tiny), "--stage", "1", "--handshake-timeout", "0"])
    assert rc == 1 and "--handshake-timeout must be more than 0 and at most 3600 seconds" in line


def test_a_flood_of_queued_steps_is_overloaded_and_other_sessions_lose_nothing(tiny, worker_bin, plain):
    """One session floods stage 0 with steps while the engine is held (--hold-batch 2 waits for a second
    session's step): past --max-session-steps each answers OVERLOADED with a retry hint; another session
    then generates what it does on a route without the flood."""
    want = _reference(plain[0])
    procs = _start(tiny, worker_bin, lambda i: ("--hold-batch", "2", "--max-session-steps", "4") if i == 0 else ())
    addresses = [p.address for p in procs]
    descs = [p.stub.Describe(pb.DescribeRequest(), timeout=10) for p in procs]
    flood = Raw(addresses[0])
    try:
        assert not procs[0].stub.OpenSession(pb.OpenSessionRequest(
            session_id="flood", epoch=1, route=route_hops(addresses, descs)), timeout=30).HasField("error")
        for k in range(40):
            flood.q.put(prefill_frame("flood", 1, [1 + k % 7]))
        overloaded = [flood.replies.get(timeout=30) for _ in range(36)]       # 4 queued, 36 refused
        assert all(f.error.code == pb.OVERLOADED and f.error.retry_after_ms >= 50 for f in overloaded), overloaded[0]
        assert "has 4 steps queued (--max-session-steps 4)" in overloaded[0].error.message
        flood.close()                                # its session closes: the hold no longer waits for it
        got = _reference(addresses)
        assert got.token_ids == want.token_ids and got.text == want.text
        assert procs[0].stub.Describe(pb.DescribeRequest(), timeout=10).overloaded >= 36
    finally:
        flood.close()
        for p in procs:
            p.stop()


def _wait_line(proc, text: str, timeout: float) -> bool:
    """Wait until a line of the worker's output (proc.log, which Proc keeps reading) holds `text`; False
    after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(text in line for line in list(proc.log)):
            return True
        time.sleep(0.05)
    return False


def test_a_peer_that_stops_reading_fails_only_its_own_stream(tiny, worker_bin, plain):
    """A client that never reads its stream (HTTP/2 flow control holds the worker's write at its window)
    is failed after --send-timeout (or once --max-send-queue-bytes behind); another session on the same
    workers generates meanwhile what it does on a route without it."""
    want = _reference(plain[0])
    procs = _start(tiny, worker_bin, lambda i: ("--send-timeout", "3") if i == 0 else ())
    addresses = [p.address for p in procs]
    descs = [p.stub.Describe(pb.DescribeRequest(), timeout=10) for p in procs]
    stuck = Raw(addresses[0], read=False, **{"grpc.http2.bdp_probe": 0})
    try:
        assert not procs[0].stub.OpenSession(pb.OpenSessionRequest(
            session_id="stuck", epoch=1, route=route_hops(addresses, descs), logits=pb.LOGITS_ALL), timeout=30).HasField("error")
        n = 400                                      # LOGITS_ALL: 400 rows of n_vocab floats, past the 64 KiB window
        assert n * descs[2].n_vocab * 4 > 4 * 65536
        stuck.q.put(pb.Frame(session_id="stuck", epoch=1, generate=pb.Generate(max_new_tokens=100)))
        stuck.q.put(prefill_frame("stuck", 1, [(7 * k) % 50 + 1 for k in range(n)], sample=True))
        got = _reference(addresses)                  # another session on the same workers
        assert got.token_ids == want.token_ids and got.text == want.text
        # the worker fails the stuck stream (it never read a frame: the first write waits past the deadline)
        assert _wait_line(procs[0], "failed a Frames stream", 120), "".join(procs[0].log)
        line = procs[0].log[-1]
        assert "(--send-timeout)" in line or "(--max-send-queue-bytes" in line, line
        threading.Thread(target=stuck._read, daemon=True).start()
        while stuck.replies.get(timeout=30) is not None:
            pass
        # a write blocked on a peer that does not read ends only by cancelling the call: CANCELLED
        assert stuck.error is not None and stuck.error.code() in (grpc.StatusCode.CANCELLED,
                                                                  grpc.StatusCode.RESOURCE_EXHAUSTED), stuck.error
        again = _reference(addresses)                # and the worker serves on
        assert again.token_ids == want.token_ids
    finally:
        stuck.close()
        for p in procs:
            p.stop()


# ------------------------------------------------------------------------------------ wildcard listen

def test_a_wildcard_listener_advertises_a_reachable_address(tiny, worker_bin, plain, pki):
    want = _reference(plain[0])
    good, _ = pki
    # stages 1 and 2 on 0.0.0.0 (plaintext with --insecure, advertising 127.0.0.1); another stage 2 there with mTLS
    procs = _start(tiny, worker_bin, lambda i: {0: (), 1: ("--listen", "0.0.0.0:0", "--insecure", "--advertise", "127.0.0.1"),
                                                2: ("--listen", "0.0.0.0:0", "--insecure", "--advertise", "127.0.0.1")}[i])
    mt = cpp(worker_bin, tiny, 2, *FLAGS, "--listen", "0.0.0.0:0", "--advertise", "127.0.0.1", *tls_flags(good["w2"]))
    try:
        for p in procs[1:] + [mt]:
            assert "0.0.0.0" not in p.address and p.address.startswith("127.0.0.1:"), p.address
        d = procs[1].stub.Describe(pb.DescribeRequest(), timeout=10)
        assert json.loads(d.descriptor_json)["address"] == procs[1].address
        got = _reference([p.address for p in procs])
        assert got.token_ids == want.token_ids
        ch, s = _stub(mt.address, good["client"])
        with ch:
            assert s.Describe(pb.DescribeRequest(), timeout=10).mutual_tls
    finally:
        mt.stop()
        for p in procs:
            p.stop()
