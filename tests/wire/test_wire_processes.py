"""Real worker processes on loopback (fake engine): the CLI end to end, and a worker killed mid-run."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest

from dgr.app.local import LocalRoute
from dgr.runtime.wire.client import RouteClient
from dgr.runtime.wire.errors import HopUnreachable
from dgr.testing.fake_engine import FakeModel

SPEC = "layers=6,embd=16,cuts=2:4,hash_layers=3,seed=8"


def _workers(spec=SPEC):
    return LocalRoute([["--fake-engine", spec, "--stage", str(i)] for i in range(len(FakeModel.from_spec(spec).ranges))])


def test_cli_generate_streams_the_same_text_as_the_library(tmp_path):
    with _workers() as r:
        with RouteClient(r.addresses) as c:
            want = c.run("Hello, ring", max_new_tokens=12).text
            ref = c.run("Hello, ring", max_new_tokens=12, logits="last")
        npz = tmp_path / "logits.npz"
        out = subprocess.run([sys.executable, "-m", "dgr", "generate", "--route", r.route, "--max-tokens", "12",
                              "--stats", "--logits-out", str(npz), "Hello, ring"],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == want + "\n"
    assert "decode" in out.stderr and "per-hop overhead" in out.stderr and "stage 2: transit in" in out.stderr
    saved = np.load(npz)
    assert saved["token_ids"].tolist() == ref.token_ids
    assert np.array_equal(saved["logits"], np.stack([ref.logits[p] for p in sorted(ref.logits)]))


@pytest.mark.parametrize("victim", [1, 2])
def test_killed_worker_mid_generation_names_the_hop(victim):
    with _workers() as r, RouteClient(r.addresses, timeout=30) as c:
        got = []
        with pytest.raises(HopUnreachable) as err:
            for ev in c.generate("keep going " * 4, max_new_tokens=5000, stop_token_ids=[]):
                got.append(ev.token_id)
                if len(got) == 10:
                    threading.Thread(target=r.kill, args=(victim,)).start()
        assert len(got) >= 10
        assert f"stage {victim} ({r.addresses[victim]})" in str(err.value)
        assert err.value.hop == f"stage {victim} ({r.addresses[victim]})"


def test_dead_worker_before_start_names_the_hop():
    with _workers() as r:
        r.kill(0)
        # `dgr generate` waits up to --timeout for a stage that is not up (tests/cli/test_cli_newcomer.py)
        out = subprocess.run([sys.executable, "-m", "dgr", "generate", "--route", r.route, "--timeout", "1", "hi"],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert f"stage 0 ({r.addresses[0]})" in out.stderr and "Traceback" not in out.stderr


def test_worker_refuses_bad_arguments():
    out = subprocess.run([sys.executable, "-m", "dgr", "worker", "serve", "--stage", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--bundle BUNDLE or --fake-engine SPEC" in out.stderr
    out = subprocess.run([sys.executable, "-m", "dgr", "worker", "serve", "--fake-engine", SPEC, "--stage", "7"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no stage 7" in out.stderr


def test_health_and_describe():
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from dgr.runtime.wire.gen import stage_pb2 as pb, stage_pb2_grpc as pb_grpc

    model = FakeModel.from_spec(SPEC)
    with _workers() as r:
        for i, address in enumerate(r.addresses):
            with grpc.insecure_channel(address) as ch:
                for service in ("", "dgr.v1.Stage"):
                    status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                                 timeout=10).status
                    assert status == health_pb2.HealthCheckResponse.SERVING
                d = pb_grpc.StageStub(ch).Describe(pb.DescribeRequest(), timeout=10)
            assert (d.identity.stage_index, d.identity.stage_count, d.identity.bundle_id) == (i, 3, model.bundle_id)
            assert (d.identity.layer_begin, d.identity.layer_end) == model.ranges[i]
            assert d.is_first == (i == 0) and d.is_last == (i == 2) and d.has_vocab
            assert d.HasField("schema_in") == (i > 0) and d.HasField("schema_out") == (i < 2)
            if i == 1:
                assert d.schema_in.token_ids and d.schema_in.layer == 2 and d.seam_bytes_per_token == 16 * 4


def test_a_taken_port_or_a_bad_address_is_refused():
    with _workers() as r:
        taken = r.addresses[0]
        out = subprocess.run([sys.executable, "-m", "dgr", "worker", "serve", "--fake-engine", SPEC, "--stage", "0",
                              "--listen", taken], capture_output=True, text=True, timeout=60)
        # dgr-worker's refusal: exit 1 and one line (docs/worker.md "Run"; bad flags alone exit 2)
        assert out.returncode == 1 and f"cannot listen on {taken}" in out.stderr
    out = subprocess.run([sys.executable, "-m", "dgr", "worker", "serve", "--fake-engine", SPEC, "--stage", "0",
                          "--listen", "nonsense"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "give HOST:PORT" in out.stderr and "Traceback" not in out.stderr


def test_a_dead_hop_at_session_open_is_named():
    with _workers() as r:
        with RouteClient(r.addresses) as c:
            c.describe()
            r.kill(2)
            with pytest.raises(HopUnreachable) as err:
                c.run("hi", max_new_tokens=2)
    assert err.value.hop == f"stage 2 ({r.addresses[2]})" and "could not open the session" in str(err.value)


def test_a_generation_stopped_early_is_closed_on_every_stage_when_its_close_returns():
    """A client that stops reading mid-generation cancels its stream, then sends CloseSession. The origin
    sees the stream end (and starts closing the session along the route) and the CloseSession, in either
    order: the close answers only once every stage has let go, whichever of the two got there first (the
    gateway's cancel and its client-gone path answer on that). Stage 1 is stopped (SIGSTOP) while the client
    closes, so no close can go past it until it is continued: the client's close must not return before."""
    import signal
    import time

    from support.gateway import open_sessions
    from support.route import fake_route

    with fake_route() as r, RouteClient(r.addresses) as c:
        for k in range(3):
            gen = c.generate([1, 2, 3, 4, 5], max_new_tokens=100_000, stop_token_ids=[])
            next(gen)
            stage1 = r.procs[1]
            stage1.send_signal(signal.SIGSTOP)
            continued = []

            def cont():
                time.sleep(1.0)
                continued.append(time.monotonic())
                stage1.send_signal(signal.SIGCONT)

            t = threading.Thread(target=cont)
            t.start()
            try:
                gen.close()                              # stream cancelled, then CloseSession (client.py)
                returned = time.monotonic()
            finally:
                t.join()
            assert continued and returned > continued[0], f"round {k}: the close returned before stage 1 could close"
            assert open_sessions(r.addresses) == [0] * len(r.addresses), k
