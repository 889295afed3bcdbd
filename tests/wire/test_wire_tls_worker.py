"""TLS on the worker (real worker processes, fake engine; raw channels through dgr.runtime.wire.tls): Describe
over TLS, mTLS refusing a peer without a certificate or from another CA, the plaintext-on-a-network
refusal, and a session's frames accepted only from the peer that opened it at this stage."""

from __future__ import annotations

import subprocess
import sys

import grpc
import numpy as np
import pytest

from dgr.runtime.wire import codec, tls as wtls
from dgr.runtime.wire.gen import stage_pb2 as pb, stage_pb2_grpc as pb_grpc

from support.wire import RawStream, open_on
from support.worker import describe, fake_route, make_ca, prefill_frame, stub, tls_flags

SPEC = "layers=4,embd=16,cuts=2,seed=11"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    good = make_ca(d / "ca", ["stage0", "stage1", "client", "intruder"])
    other = make_ca(d / "other", ["stranger"])
    return good, other


def _mtls_route(good):
    return fake_route(SPEC, per_stage={i: tls_flags(good[f"stage{i}"]) for i in range(2)})


def test_a_tls_worker_answers_describe_over_tls(pki):
    good, _ = pki
    server_only = wtls.TlsConfig(good["stage0"].cert, good["stage0"].key)     # TLS without client certificates
    with fake_route(SPEC, per_stage={0: tls_flags(server_only, mutual=False), 1: tls_flags(good["stage1"])}) as r:
        assert "TLS serving on" in "".join(r.logs[0])
        client = wtls.TlsConfig(good["client"].cert, good["client"].key, good["client"].ca)
        d = describe(r.addresses[0], client)
        assert d.tls and not d.mutual_tls and d.member == "stage0"
        d1 = describe(r.addresses[1], client)
        assert d1.tls and d1.mutual_tls and d1.member == "stage1"
        with pytest.raises(grpc.RpcError) as err:                  # plaintext to a TLS listener
            describe(r.addresses[0])
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mtls_refuses_a_peer_without_a_certificate_or_from_another_ca(pki):
    good, other = pki
    with _mtls_route(good) as r:
        no_cert = grpc.secure_channel(r.addresses[1], grpc.ssl_channel_credentials(
            root_certificates=good["client"].ca.read_bytes()))
        with pytest.raises(grpc.RpcError) as err, no_cert:
            pb_grpc.StageStub(no_cert).Describe(pb.DescribeRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # a certificate from another CA (it trusts ours, so only the worker's check refuses it)
        stranger = wtls.TlsConfig(other["stranger"].cert, other["stranger"].key, good["client"].ca)
        with pytest.raises(grpc.RpcError) as err:
            describe(r.addresses[1], stranger)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert describe(r.addresses[1], good["client"]).mutual_tls    # a member of the CA gets in


def test_a_network_listen_without_tls_refuses_to_start_unless_insecure(pki):
    cmd = [sys.executable, "-m", "dgr", "worker", "serve", "--fake-engine", SPEC, "--stage", "0",
           "--listen", "0.0.0.0:0"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "refusing to listen on 0.0.0.0:0 without TLS" in out.stderr
    assert "--insecure" in out.stderr and "Traceback" not in out.stderr
    with fake_route(SPEC, "--listen", "0.0.0.0:0", "--insecure") as r:
        assert "plaintext serving on" in "".join(r.logs[0])
    good, _ = pki
    with fake_route(SPEC, "--listen", "0.0.0.0:0", *tls_flags(good["stage0"])) as r:
        assert "mutual TLS serving on" in "".join(r.logs[0])


def test_frames_of_a_session_are_accepted_only_from_the_peer_that_opened_it(pki):
    """Under mutual TLS a session lives in its opener's namespace (docs/security.md): another member's frame
    naming its id names no session at all."""
    good, _ = pki
    with _mtls_route(good) as r:
        descs = [describe(a, good["client"]) for a in r.addresses]
        ch0, s1 = stub(r.addresses[1], good["stage0"])              # stage 0's certificate opens at stage 1
        with ch0:
            assert not open_on(s1, r.addresses, 1, descs, "s", 1).HasField("error")
        intruder = RawStream(r.addresses[1], good["intruder"])           # another member of the same CA
        step = prefill_frame("s", 1, [3, 4, 5])
        step.step.ClearField("token_ids")
        step.step.schema.CopyFrom(descs[1].schema_in)
        step.step.boundary.CopyFrom(codec.encode(np.zeros((3, 1, 16), np.float32), pb.F32))
        step.step.token_ids.extend([3, 4, 5])
        reply = intruder.ask(step)
        assert reply.error.code == pb.UNKNOWN_SESSION
        assert "no open session s epoch 1: open it (OpenSession) first" in reply.error.message
        intruder.close()
        opener = RawStream(r.addresses[1], good["stage0"])               # the opener's own frames reach it
        reply = opener.ask(step, expect_reply=False)
        assert reply is None or reply.error.code not in (pb.WRONG_STAGE, pb.UNKNOWN_SESSION), reply
        opener.close()

