"""A hostile member (issue 35, docs/security.md): a peer holding a valid certificate of the mesh's CA, not on
the victim's route, tries to change, read, evict or kill another member's work through every RPC and link.

Real dgr-worker processes on loopback under mutual TLS, certificates from `dgr certs` (tmp), the real engine
on a tiny synthetic llama split in 3 stages; the intruder's own server is a real gRPC server holding a member
certificate. Every attack is forced (a stopped worker, a chosen step), never timed. Each ends by checking
the victim's tokens and logits bit for bit against an undisturbed run, and that the worker still serves.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import threading
from concurrent import futures

import grpc
import numpy as np
import pytest

from dgr.runtime.wire.client import RouteClient
from dgr.runtime.wire.gen import stage_pb2 as pb, stage_pb2_grpc as pb_grpc
from dgr.runtime.wire.prefix import PREFIX_BLOCK_TOKENS, block_hashes, prompt_blocks

from support.wire import RawStream
from support.worker import cpp_stages, describe, make_ca, prefill_frame, route_hops, stub, tls_flags, wait_for

FLAGS = ("--threads", "1", "--n-ctx", "512")
MAX_NEW = 8
# A shared system prompt the victim sends, and the attacker's own, different text of the same length.
VICTIM = [(5 * k + 3) % 60 + 1 for k in range(3 * PREFIX_BLOCK_TOKENS + 5)]
ATTACKER = [(11 * k + 7) % 60 + 1 for k in range(len(VICTIM))]


@pytest.fixture(scope="module")
def tiny(tiny_route):
    return tiny_route[1]                            # 6 llama layers in 3 stages (tests/conftest.py)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_ca(tmp_path_factory.mktemp("pki"), ["w0", "w1", "w2", "client", "intruder", "evil-server"])


def _route(tiny, worker_bin, pki, per_stage=lambda i: ()):
    return cpp_stages(worker_bin, tiny, 3, *FLAGS, per_stage=lambda i: (*tls_flags(pki[f"w{i}"]), *per_stage(i)))


@pytest.fixture(scope="module")
def route(tiny, worker_bin, pki):
    procs = _route(tiny, worker_bin, pki)
    try:
        yield procs
    finally:
        for p in procs:
            print(p.stop()[-3000:])


def _run(addresses, tls, ids, **kw):
    with RouteClient(addresses, tls=tls) as c:
        r = c.run(ids, max_new_tokens=MAX_NEW, stop_token_ids=[], logits="last", **kw)
        return r, c.cached_tokens


def _same(a, b):
    assert a.token_ids == b.token_ids and a.text == b.text
    assert sorted(a.logits) == sorted(b.logits)
    for p in a.logits:
        assert np.array_equal(a.logits[p].view(np.uint32), b.logits[p].view(np.uint32)), f"position {p}"


def _serves(procs, pki):
    for p in procs:
        assert p.p.poll() is None, f"worker {p.address} died: " + "".join(p.log)[-2000:]
        assert describe(p.address, pki["client"]).identity.bundle_id


def _descs(addresses, tls):
    return [describe(a, tls) for a in addresses]


def _generate(raw, sid, epoch, ids, max_new=MAX_NEW):
    """The owner's own generation over a raw stream to stage 0: its token ids, in order."""
    raw.q.put(pb.Frame(session_id=sid, epoch=epoch, generate=pb.Generate(max_new_tokens=max_new)))
    raw.q.put(prefill_frame(sid, epoch, ids, sample=True))
    return _tokens(raw)


def _tokens(raw, got=None):
    """Token ids from a raw stream until the one marked done (after `got`, those already read); no error."""
    got = list(got or [])
    while True:
        f = raw.replies.get(timeout=60)
        assert f is not None and not f.HasField("error"), f
        if f.HasField("token"):
            got.append(f.token.token_id)
            if f.token.done:
                return got


# ------------------------------------------------------------------------------------- the prefix cache

@pytest.mark.parametrize("shared", [False, True], ids=["per-member", "shared"])
def test_a_member_cannot_poison_the_prefix_cache_by_naming_blocks_it_did_not_run(tiny, worker_bin, pki, shared):
    """The attacker runs its own text and closes its session naming the block hashes of the victim's prompt
    (a guessed shared system prompt): the victim's next run must not restore the attacker's state."""
    extra = (lambda i: ("--prefix-cache-shared",)) if shared else (lambda i: ())
    procs = _route(tiny, worker_bin, pki, extra)
    addresses = [p.address for p in procs]
    try:
        want, _ = _run(addresses, pki["client"], VICTIM, prefix_cache=False)    # cold: the cache unused
        tls = pki["intruder"]
        hops = route_hops(addresses, _descs(addresses, tls))
        ch, s0 = stub(addresses[0], tls)
        with ch:
            assert not s0.OpenSession(pb.OpenSessionRequest(session_id="poison", epoch=1, route=hops),
                                      timeout=30).HasField("error")
            raw = RawStream(addresses[0], tls)
            try:
                assert _generate(raw, "poison", 1, ATTACKER, max_new=2)
            finally:
                raw.close()
            lie = block_hashes(VICTIM[: 2 * PREFIX_BLOCK_TOKENS])
            r = s0.CloseSession(pb.CloseSessionRequest(session_id="poison", epoch=1, chain=True, prefix_blocks=lie,
                                                       prefix_block_tokens=PREFIX_BLOCK_TOKENS), timeout=30)
            assert not r.HasField("error"), r
        got, cached = _run(addresses, pki["client"], VICTIM, prefix_cache=True)
        assert cached == 0, f"the victim restored {cached} positions the attacker filed under its prompt"
        _same(got, want)
        # the cache still serves its owner: a second run of the victim's prompt restores its own prefix, exactly
        again, cached = _run(addresses, pki["client"], VICTIM, prefix_cache=True)
        assert cached == 2 * PREFIX_BLOCK_TOKENS or cached == 3 * PREFIX_BLOCK_TOKENS
        _same(again, want)
        _serves(procs, pki)
    finally:
        for p in procs:
            print(p.stop()[-3000:])


def test_a_member_cannot_learn_whether_another_sent_a_prompt(route, pki):
    addresses = [p.address for p in route]
    _run(addresses, pki["client"], VICTIM, prefix_cache=True)          # the victim's prompt, kept on close
    _, cached = _run(addresses, pki["client"], VICTIM, prefix_cache=True)
    assert cached > 0                                                  # its owner finds it
    tls = pki["intruder"]
    hops = route_hops(addresses, _descs(addresses, tls))
    ch, s0 = stub(addresses[0], tls)
    with ch:
        r = s0.OpenSession(pb.OpenSessionRequest(session_id="probe", epoch=1, route=hops,
                                                 prefix_blocks=prompt_blocks(VICTIM),
                                                 prefix_block_tokens=PREFIX_BLOCK_TOKENS), timeout=30)
        assert not r.HasField("error")
        assert r.cached_tokens == 0, "another member's prompt answered from the cache"
        s0.CloseSession(pb.CloseSessionRequest(session_id="probe", epoch=1, chain=True), timeout=30)


# --------------------------------------------------------------------------------------- session ids

@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_member_cannot_evict_another_members_session_by_opening_its_id_at_a_newer_epoch(route, pki, stage):
    addresses = [p.address for p in route]
    want, _ = _run(addresses, pki["client"], VICTIM[:20], prefix_cache=False)
    descs = _descs(addresses, pki["client"])
    hops = route_hops(addresses, descs)
    sid = f"victim-{stage}"
    ch, s0 = stub(addresses[0], pki["client"])
    with ch:
        assert not s0.OpenSession(pb.OpenSessionRequest(session_id=sid, epoch=1, route=hops), timeout=30).HasField("error")
    # the intruder opens the same id at a newer epoch, at stage `stage` (as stage 0 would open it there:
    # under the id as the client named it, and as stage 0 forwards it)
    ch, s = stub(addresses[stage], pki["intruder"])
    with ch:
        for name in {sid, f"client/{sid}"}:
            req = pb.OpenSessionRequest(session_id=name, epoch=7, route=hops, hop_index=stage)
            if stage:
                req.upstream.CopyFrom(descs[stage - 1])
            s.OpenSession(req, timeout=30)
        owner = RawStream(addresses[0], pki["client"])
        try:
            assert _generate(owner, sid, 1, VICTIM[:20]) == want.token_ids
        finally:
            owner.close()
        for name in {sid, f"client/{sid}"}:         # the intruder's own sessions end: no slot stays held
            s.CloseSession(pb.CloseSessionRequest(session_id=name, epoch=7, chain=True), timeout=30)
    _serves(route, pki)


def _crafted(pki, name: str, common_names: list[str]):
    """A certificate of the route's own CA whose subject holds `common_names` (dgr certs never issues such a
    name, but another tool over the same CA may): as a TlsConfig."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    from dgr.app import certs

    d = pki["client"].ca.parent
    ca_key = serialization.load_pem_private_key((d / certs.CA_KEY).read_bytes(), password=None)
    ca_cert = x509.load_pem_x509_certificate((d / certs.CA_CERT).read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    now = ca_cert.not_valid_before_utc
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, n) for n in common_names]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(ca_cert.not_valid_after_utc)
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(__import__("ipaddress").ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    (d / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / f"{name}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                      serialization.NoEncryption()))
    return type(pki["client"])(d / f"{name}.pem", d / f"{name}.key", pki["client"].ca)


def test_two_members_whose_common_names_join_alike_are_two_members(route, pki):
    """A member's name is its certificate's common name as gRPC reports it for the peer. A certificate naming
    "a" and "b" and another naming "a,b" (names a join of several common names would confuse) are two
    members: one cannot close the other's session, which generates as an undisturbed run does."""
    addresses = [p.address for p in route]
    victim, intruder = _crafted(pki, "two-names", ["a", "b"]), _crafted(pki, "one-name", ["a,b"])
    want, _ = _run(addresses, pki["client"], VICTIM[:20], prefix_cache=False)
    hops = route_hops(addresses, _descs(addresses, victim))
    ch, s0 = stub(addresses[0], victim)
    with ch:
        assert not s0.OpenSession(pb.OpenSessionRequest(session_id="joined", epoch=1, route=hops), timeout=30).HasField("error")
    ch, s = stub(addresses[0], intruder)
    with ch:
        s.CloseSession(pb.CloseSessionRequest(session_id="joined", epoch=1, chain=True), timeout=30)
    owner = RawStream(addresses[0], victim)
    try:
        assert _generate(owner, "joined", 1, VICTIM[:20]) == want.token_ids
    finally:
        owner.close()
    _serves(route, pki)


# ---------------------------------------------------------------------------------------- links

class EvilStage(pb_grpc.StageServicer):
    """The intruder's own server, named as the next hop of the intruder's own session: it answers OpenSession
    as the real stages would, and on the link the victim's stage 0 opens to it, writes back forged tokens for
    the victim's session."""

    def __init__(self, real_hops, forged):
        self.real_hops, self.forged, self.got_frame = real_hops, forged, threading.Event()

    def OpenSession(self, request, context):
        return pb.OpenSessionReply(hops=self.real_hops)

    def CloseSession(self, request, context):
        return pb.CloseSessionReply()

    def Frames(self, request_iterator, context):
        inbox = queue.Queue()

        def read():
            try:
                for f in request_iterator:
                    inbox.put(f)
            except grpc.RpcError:
                pass                                 # the victim's stage ended the link: what the test wants

        threading.Thread(target=read, daemon=True).start()
        inbox.get(timeout=60)                        # the intruder's own step arrived: the link is open
        for f in self.forged:
            yield f
        self.got_frame.set()
        while context.is_active():
            try:
                inbox.get(timeout=1)
            except queue.Empty:
                pass


def test_a_next_hop_cannot_feed_tokens_into_a_session_it_is_not_on(tiny, worker_bin, pki):
    """The intruder names its own server as stage 1 of its own session; what that server writes back on the
    link must never reach the victim's session, whatever id and epoch it names."""
    procs = _route(tiny, worker_bin, pki, lambda i: ("--test-stop-at", "victim:1:20") if i == 2 else ())
    addresses = [p.address for p in procs]
    evil = None
    try:
        want, _ = _run(addresses, pki["client"], VICTIM[:20], prefix_cache=False, )
        descs = _descs(addresses, pki["client"])
        # the victim: opened, generating, its ring held at stage 2 (stopped exactly before its first decode step)
        ch, s0 = stub(addresses[0], pki["client"])
        with ch:
            assert not s0.OpenSession(pb.OpenSessionRequest(session_id="victim", epoch=1,
                                                            route=route_hops(addresses, descs)), timeout=30).HasField("error")
        owner = RawStream(addresses[0], pki["client"])
        owner.q.put(pb.Frame(session_id="victim", epoch=1, generate=pb.Generate(max_new_tokens=MAX_NEW)))
        owner.q.put(prefill_frame("victim", 1, VICTIM[:20], sample=True))
        first = owner.replies.get(timeout=60)
        assert first.HasField("token") and first.token.token_id == want.token_ids[0], first
        assert wait_for(lambda: "--test-stop-at" in "".join(procs[2].log) or _stopped(procs[2]), 30)
        forged = [pb.Frame(session_id=name, epoch=1, token=pb.Token(token_id=3, position=20 + k))
                  for name in ("victim", "client/victim") for k in range(3)]
        forged += [pb.Frame(session_id=name, epoch=1, error=pb.WireError(code=pb.ENGINE, message="forged"))
                   for name in ("victim", "client/victim")]
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        evil = EvilStage(descs[1:], forged)
        pb_grpc.add_StageServicer_to_server(evil, server)
        ev = pki["evil-server"]
        creds = grpc.ssl_server_credentials([(ev.key.read_bytes(), ev.cert.read_bytes())],
                                            root_certificates=ev.ca.read_bytes(), require_client_auth=True)
        port = server.add_secure_port("127.0.0.1:0", creds)
        server.start()
        hops = route_hops(addresses, descs)
        hops[1].address = f"127.0.0.1:{port}"
        tls = pki["intruder"]
        ch, s0 = stub(addresses[0], tls)
        with ch:
            assert not s0.OpenSession(pb.OpenSessionRequest(session_id="mine", epoch=1, route=hops),
                                      timeout=30).HasField("error")
        mine = RawStream(addresses[0], tls)
        mine.q.put(prefill_frame("mine", 1, ATTACKER[:4]))
        assert evil.got_frame.wait(60), "stage 0 never opened its link to the intruder's server"
        mine.close()
        os.kill(procs[2].p.pid, signal.SIGCONT)
        got = _tokens(owner, [first.token.token_id])
        owner.close()
        assert got == want.token_ids
        _serves(procs, pki)
    finally:
        if evil is not None:
            server.stop(0)
        for p in procs:
            if p.p.poll() is None:
                os.kill(p.p.pid, signal.SIGCONT)
            print(p.stop()[-3000:])


def _stopped(proc) -> bool:
    try:
        with open(f"/proc/{proc.p.pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "T"
    except OSError:
        return False


# ------------------------------------------------------------------------------- grammar and schema

def _last_stage_open(addresses, descs, tls, sampling):
    hops = route_hops(addresses, descs)
    ch, s0 = stub(addresses[0], tls)
    with ch:
        return s0.OpenSession(pb.OpenSessionRequest(session_id="g", epoch=1, route=hops, sampling=sampling), timeout=60)


@pytest.mark.parametrize("what", ["grammar", "json_schema"])
def test_a_deeply_nested_grammar_is_refused_by_name_and_kills_nothing(route, pki, what):
    addresses = [p.address for p in route]
    descs = _descs(addresses, pki["intruder"])
    if what == "grammar":                            # 40 KB: crashed the last stage (SIGSEGV)
        sampling = pb.Sampling(grammar="root ::= " + "(" * 20000 + '"a"' + ")" * 20000)
    else:                                            # 50 KB: stalled every session on it while converted
        sampling = pb.Sampling(json_schema='{"type":"array","items":' * 2000 + '{"type":"string"}' + "}" * 2000)
    r = _last_stage_open(addresses, descs, pki["intruder"], sampling)
    assert r.HasField("error") and r.error.code == pb.ENGINE, r
    assert "nest" in r.error.message and "--max-grammar-depth" in r.error.message, r.error.message
    _serves(route, pki)
    want, _ = _run(addresses, pki["client"], VICTIM[:20], prefix_cache=False)
    assert len(want.token_ids) == MAX_NEW


@pytest.mark.parametrize("what", ["grammar", "json_schema"])
def test_a_grammar_whose_repetitions_expand_without_end_is_refused_and_costs_nothing(route, pki, what):
    """157 KB of `"a"{0,2000}` took llama.cpp's parser 34 s and 5 GB: a few at once would kill the last stage.
    Refused by name before it is parsed (the repetitions' expansion over DGR_GRAMMAR_MAX_EXPANSION), at once,
    and the worker's memory stays where it was."""
    addresses = [p.address for p in route]
    descs = _descs(addresses, pki["intruder"])
    if what == "grammar":
        sampling = pb.Sampling(grammar="root ::= " + ' "a"{0,2000}' * 15000)
    else:                                            # minLength/maxLength become {m,n} in the GBNF
        props = {f"p{i}": {"type": "string", "minLength": 1, "maxLength": 2000} for i in range(2000)}
        sampling = pb.Sampling(json_schema=json.dumps({"type": "object", "properties": props, "required": list(props)}))
    rss0 = route[2].rss_kib()
    r = _last_stage_open(addresses, descs, pki["intruder"], sampling)
    assert r.HasField("error") and r.error.code == pb.ENGINE, r
    assert "repetitions" in r.error.message and "expand to more than 500000 elements" in r.error.message, r.error.message
    assert route[2].rss_kib() - rss0 < 256 * 1024, (rss0, route[2].rss_kib())
    _serves(route, pki)
    want, _ = _run(addresses, pki["client"], VICTIM[:20], prefix_cache=False)
    assert len(want.token_ids) == MAX_NEW


@pytest.mark.parametrize("where", ["last stage", "route"])
def test_one_members_grammars_do_not_hold_up_anothers(tiny, worker_bin, pki, where):
    """A grammar's conversion takes up to ~0.3 s, so a worker runs GRAMMARS_AT_ONCE (2) at once and the rest wait.
    A member opening 24 sessions with the costliest grammars the bounds allow, straight at the last stage or
    through the route (where the last stage sees every client's opens come from one member, stage 1), queued
    another member's grammar behind nearly all of them (its open answered after 21-23 of the flood's). Members
    now take turns at every stage (trust/turns.h), so the victim's open, through the whole route, is answered
    while most of the flood still waits (after 4). Counted in answers, not timed. Each of the flood's opens is a
    session of its own (room for all: --max-sessions 32), and only opens that opened count: with one id and newer
    epochs, an open that meets a newer epoch is refused at once as stale, and under load (arrivals reordered) those
    quick refusals were counted as the flood's work (19 of 24 in a CI run)."""
    procs = _route(tiny, worker_bin, pki, lambda i: ("--max-sessions", "32"))
    addresses = [p.address for p in procs]
    n = 24
    try:
        descs = _descs(addresses, pki["intruder"])
        hops = route_hops(addresses, descs)
        slow = pb.Sampling(grammar="root ::= " + ' "a"{0,2000}' * 124)    # 496,000 elements counted: inside the bound
        at = 2 if where == "last stage" else 0
        answered = []
        lock = threading.Lock()

        def flood(k):
            ch, s = stub(addresses[at], pki["intruder"])
            with ch:
                r = s.OpenSession(pb.OpenSessionRequest(session_id=f"flood-{k}", epoch=1, route=hops, hop_index=at,
                                                        upstream=descs[1] if at else None, sampling=slow), timeout=300)
            assert not r.HasField("error"), r
            with lock:
                answered.append(k)

        with futures.ThreadPoolExecutor(n) as ex:
            fs = [ex.submit(flood, k) for k in range(n)]
            wait_for(lambda: answered, timeout=120)   # the first is answered: every other one has been sent
            ch, s0 = stub(addresses[0], pki["client"])
            with ch:
                r = s0.OpenSession(pb.OpenSessionRequest(session_id="victim", epoch=1, route=hops,
                                                         sampling=pb.Sampling(grammar='root ::= "a"')), timeout=300)
                with lock:
                    before = len(answered)
                assert not r.HasField("error"), r
                s0.CloseSession(pb.CloseSessionRequest(session_id="victim", epoch=1, chain=True), timeout=30)
            for f in fs:
                f.result()
        print(f"{where}: the victim's open was answered after {before} of the flood's {n}")
        assert before <= n // 2, f"the victim's open was answered after {before} of the flood's {n}"
        _serves(procs, pki)
    finally:
        for p in procs:
            print(p.stop()[-3000:])


def test_a_generate_frame_cannot_carry_more_ids_than_a_session_holds(route, pki):
    """A million client-supplied context ids made one Generate frame expensive for everyone at stage 0."""
    addresses = [p.address for p in route]
    hops = route_hops(addresses, _descs(addresses, pki["intruder"]))
    ch, s0 = stub(addresses[0], pki["intruder"])
    with ch:
        assert not s0.OpenSession(pb.OpenSessionRequest(session_id="big", epoch=1, route=hops), timeout=30).HasField("error")
        raw = RawStream(addresses[0], pki["intruder"])
        try:
            r = raw.ask(pb.Frame(session_id="big", epoch=1, generate=pb.Generate(
                max_new_tokens=4, context_ids=[1] * 600_000, draft_source="ngram")), expect_reply=True)
            assert r.error.code == pb.BAD_FRAME, r
            assert "generate.context_ids holds 600000 ids, more than the session's context (512)" in r.error.message
        finally:
            raw.close()
        s0.CloseSession(pb.CloseSessionRequest(session_id="big", epoch=1, chain=True), timeout=30)
    _serves(route, pki)


def test_one_member_cannot_hold_every_session_slot(tiny, worker_bin, pki):
    """--max-sessions-per-member 2 at stage 0 (where the members are the clients; past it, the member that
    opens a session is the previous hop, which carries every client's): a member holding its two sessions is
    refused a third (OVERLOADED, naming the flag), and another member's route is served meanwhile, exactly."""
    procs = _route(tiny, worker_bin, pki, lambda i: ("--max-sessions", "4") + (("--max-sessions-per-member", "2") if i == 0 else ()))
    addresses = [p.address for p in procs]
    try:
        want, _ = _run(addresses, pki["client"], VICTIM[:20], prefix_cache=False)
        hops = route_hops(addresses, _descs(addresses, pki["intruder"]))
        ch, s0 = stub(addresses[0], pki["intruder"])
        with ch:
            for k in range(2):
                assert not s0.OpenSession(pb.OpenSessionRequest(session_id=f"hog-{k}", epoch=1, route=hops),
                                          timeout=30).HasField("error")
            r = s0.OpenSession(pb.OpenSessionRequest(session_id="hog-2", epoch=1, route=hops), timeout=30)
            assert r.error.code == pb.OVERLOADED and r.error.retry_after_ms > 0, r
            assert "this member holds 2 sessions here (--max-sessions-per-member 2)" in r.error.message
            got, _ = _run(addresses, pki["client"], VICTIM[:20], prefix_cache=False)
            _same(got, want)
            s0.CloseSession(pb.CloseSessionRequest(session_id="hog-0", epoch=1, chain=True), timeout=30)
            assert not s0.OpenSession(pb.OpenSessionRequest(session_id="hog-2", epoch=1, route=hops),
                                      timeout=30).HasField("error")
        _serves(procs, pki)
    finally:
        for p in procs:
            print(p.stop()[-3000:])


def test_one_member_cannot_fill_the_step_queue(tiny, worker_bin, pki, route):
    """--max-queued-steps-per-member 2 at stage 0, batches held back (--hold-batch 2) so that steps stay queued:
    a member's third queued step is refused (OVERLOADED, naming the flag) while another member's step is taken;
    closing the member's session frees its share; and another member's route is served exactly."""
    want, _ = _run([p.address for p in route], pki["client"], VICTIM[:20], prefix_cache=False)
    procs = _route(tiny, worker_bin, pki, lambda i: ("--max-queued-steps-per-member", "2", "--hold-batch", "2") if i == 0 else ())
    addresses = [p.address for p in procs]

    def queued():
        return describe(addresses[0], pki["client"]).queued_steps

    try:
        hops = route_hops(addresses, _descs(addresses, pki["intruder"]))
        ch, s0 = stub(addresses[0], pki["intruder"])
        cch, c0 = stub(addresses[0], pki["client"])
        with ch, cch:
            raw, other = RawStream(addresses[0], pki["intruder"]), RawStream(addresses[0], pki["client"])
            try:
                for sid in ("q1", "q2"):
                    assert not s0.OpenSession(pb.OpenSessionRequest(session_id=sid, epoch=1, route=hops),
                                              timeout=30).HasField("error")
                    for k in range(2):
                        assert raw.ask(prefill_frame(sid, 1, ATTACKER[4 * k:4 * k + 4], start=4 * k), expect_reply=False) is None
                    r = raw.ask(prefill_frame(sid, 1, ATTACKER[8:12], start=8))
                    assert r.error.code == pb.OVERLOADED and r.error.retry_after_ms > 0, r
                    assert "this member has 2 steps queued here (--max-queued-steps-per-member 2)" in r.error.message, r
                    if sid == "q1":                 # another member's step is taken, and runs beside the first
                        assert not c0.OpenSession(pb.OpenSessionRequest(session_id="v", epoch=1, route=hops),
                                                  timeout=30).HasField("error")
                        assert other.ask(prefill_frame("v", 1, VICTIM[:4]), expect_reply=False) is None
                        assert wait_for(lambda: queued() == 1, 30), queued()
                    # the member's session closed: its queued steps go, and with them its share
                    s0.CloseSession(pb.CloseSessionRequest(session_id=sid, epoch=1, chain=True), timeout=30)
                    assert queued() == 0
                c0.CloseSession(pb.CloseSessionRequest(session_id="v", epoch=1, chain=True), timeout=30)
            finally:
                raw.close()
                other.close()
        got, _ = _run(addresses, pki["client"], VICTIM[:20], prefix_cache=False)
        _same(got, want)
        _serves(procs, pki)
    finally:
        for p in procs:
            print(p.stop()[-3000:])


def test_addresses_a_member_names_leave_no_channel_behind(tiny, worker_bin, pki, tmp_path):
    """A member opens sessions whose next hop is each time another address (ports nobody serves): every
    attempt fails, and the channels the worker opened to them are dropped again, so naming ever new addresses
    cannot grow the worker; a unix: socket is refused before anything is dialled."""
    import socket
    import ssl
    import urllib.request

    from support.metrics import value
    from prometheus_client.parser import text_string_to_metric_families

    procs = _route(tiny, worker_bin, pki, lambda i: ("--metrics-listen", "127.0.0.1:0") if i == 0 else ())
    addresses = [p.address for p in procs]
    try:
        [url] = [line.split("metrics on ")[1].split()[0] for line in procs[0].log if "metrics on " in line]
        ctx = ssl.create_default_context(cafile=str(pki["client"].ca))
        ctx.load_cert_chain(str(pki["client"].cert), str(pki["client"].key))

        def channels():
            with urllib.request.urlopen(url, context=ctx, timeout=10) as r:
                text = r.read().decode()
            samples = {(s.name, ()): s.value for f in text_string_to_metric_families(text) for s in f.samples}
            return value(samples, "dgr_worker_outgoing_channels")

        hops = route_hops(addresses, _descs(addresses, pki["intruder"]))
        ch, s0 = stub(addresses[0], pki["intruder"])
        with ch:
            seen = []                                # the gauge after each attempt: it counts what was dialled
            for k in range(30):
                with socket.socket() as sk:          # a port nobody serves
                    sk.bind(("127.0.0.1", 0))
                    hops[1].address = f"127.0.0.1:{sk.getsockname()[1]}"
                r = s0.OpenSession(pb.OpenSessionRequest(session_id=f"scan-{k}", epoch=1, route=hops), timeout=30)
                assert r.error.code == pb.HOP_UNREACHABLE, r
                assert "no dgr worker answered at that address" in r.error.message, r.error.message
                seen.append(channels())
            # the worker prunes every 2 s whenever it likes, so one reading may follow a prune; not all of them
            assert max(seen) >= 1, seen
            hops[1].address = f"unix:{tmp_path / 'x.sock'}"
            r = s0.OpenSession(pb.OpenSessionRequest(session_id="unix", epoch=1, route=hops), timeout=30)
            assert r.error.code == pb.BAD_FRAME and "does not connect to peer address 'unix:" in r.error.message, r
        assert wait_for(lambda: channels() == 0, 30), channels()
        got, _ = _run(addresses, pki["client"], VICTIM[:20], prefix_cache=False)
        assert len(got.token_ids) == MAX_NEW
        _serves(procs, pki)
    finally:
        for p in procs:
            print(p.stop()[-3000:])


GBNF_PIECES = ["root ::= ", "x ::= ", "(", ")", '"a"', '"\\""', "[a-z]", "[^\\]]", "|", "*", "+", "?", "{2,3}", " ",
               "\n", "x", "# note\n", "\\", "\u00e9", "[", "]", '"', "::=", "{", "}"]
JSON_LEAVES = ['{"type":"string"}', '{"type":"integer","minimum":3}', '{"$ref":"#"}', '{"enum":["a",1,null]}',
               '{"type":"string","pattern":"^(a|b)+$"}', '{"const":"x"}', "true", "{}"]


def _schema(draw_tree) -> str:
    kind, parts = draw_tree
    if kind == "leaf":
        return parts
    if kind == "array":
        return '{"type":"array","items":' + _schema(parts[0]) + "}"
    if kind == "object":
        props = ",".join(f'"p{i}":{_schema(p)}' for i, p in enumerate(parts))
        return '{"type":"object","properties":{' + props + '},"required":["p0"]}'
    return '{"anyOf":[' + ",".join(_schema(p) for p in parts) + "]}"


def test_random_grammars_and_schemas_are_answered_and_kill_nothing(route, pki):
    """Fuzz (hypothesis, derandomized): random GBNF from grammar pieces and random nested JSON schemas, each
    opened as a session's grammar at the last stage. Every one is either accepted or refused with a typed
    error; the worker serves on (the sanitizer jobs run this too: docs/sanitizers.md)."""
    from hypothesis import HealthCheck, given, settings, strategies as st

    addresses = [p.address for p in route]
    descs = _descs(addresses, pki["intruder"])
    hops = route_hops(addresses, descs)
    trees = st.recursive(st.tuples(st.just("leaf"), st.sampled_from(JSON_LEAVES)),
                         lambda kids: st.tuples(st.sampled_from(["array", "object", "anyOf"]),
                                                st.lists(kids, min_size=1, max_size=3)), max_leaves=12)
    grammars = st.lists(st.sampled_from(GBNF_PIECES), min_size=1, max_size=60).map("".join)
    seen = {"ok": 0, "refused": 0}
    ch, s0 = stub(addresses[0], pki["intruder"])

    @settings(max_examples=80, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(grammars.map(lambda g: pb.Sampling(grammar=g)),
                     trees.map(lambda t: pb.Sampling(json_schema=_schema(t)))))
    def one(sampling):
        sid = f"fuzz-{sum(seen.values())}"
        r = s0.OpenSession(pb.OpenSessionRequest(session_id=sid, epoch=1, route=hops, sampling=sampling), timeout=60)
        if r.HasField("error"):
            assert r.error.code == pb.ENGINE and r.error.message, r
            seen["refused"] += 1
        else:
            seen["ok"] += 1
            s0.CloseSession(pb.CloseSessionRequest(session_id=sid, epoch=1, chain=True), timeout=30)

    with ch:
        one()
    assert seen["ok"] and seen["refused"], seen
    _serves(route, pki)
