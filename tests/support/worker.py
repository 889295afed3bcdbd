"""Helpers for the worker-side tests of bounded resources, drain and TLS: worker processes with extra
flags, raw stubs over plaintext or TLS, sessions opened along a route by hand, and a local CA."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import grpc

from dgr.app.local import FakeRoute, LocalRoute
from dgr.runtime.wire import tls as wtls
from dgr.runtime.wire.gen import stage_pb2 as pb, stage_pb2_grpc as pb_grpc


def fake_route(spec: str, *extra: str, per_stage: dict[int, list[str]] | None = None) -> LocalRoute:
    """One `dgr-worker --fake-engine spec` process per stage, each with `extra` flags."""
    return FakeRoute.of(spec, extra=lambda stage, _replica: [*extra, *(per_stage or {}).get(stage, [])])


def stub(address: str, tls: wtls.TlsConfig | None = None) -> tuple[grpc.Channel, pb_grpc.StageStub]:
    ch = wtls.channel(address, tls)
    return ch, pb_grpc.StageStub(ch)


def describe(address: str, tls: wtls.TlsConfig | None = None) -> pb.StageDescription:
    ch, s = stub(address, tls)
    with ch:
        return s.Describe(pb.DescribeRequest(), timeout=10)


def route_hops(addresses: list[str], descs: list[pb.StageDescription]) -> list[pb.Hop]:
    return [pb.Hop(address=a, bundle_id=d.identity.bundle_id, stage_index=d.identity.stage_index,
                   layer_begin=d.identity.layer_begin, layer_end=d.identity.layer_end)
            for a, d in zip(addresses, descs)]


def open_route(s: pb_grpc.StageStub, hops: list[pb.Hop], sid: str, epoch: int = 1) -> pb.OpenSessionReply:
    """OpenSession on stage 0 for the whole route, as a client would (and then abandon it, if you like)."""
    return s.OpenSession(pb.OpenSessionRequest(session_id=sid, epoch=epoch, route=hops, hop_index=0), timeout=30)


def prefill_frame(sid: str, epoch: int, ids: list[int], start: int = 0, sample: bool = False) -> pb.Frame:
    """A stage-0 step: token ids at positions start.. (the cache must hold `start` positions)."""
    return pb.Frame(session_id=sid, epoch=epoch, step=pb.Step(
        positions=list(range(start, start + len(ids))), token_ids=ids, cache_expect=start, sample=sample))


def wait_for(pred, timeout: float, every: float = 0.1):
    """Poll `pred` until it returns something truthy; that value, or None after `timeout` seconds."""
    end = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() > end:
            return v
        time.sleep(every)


def sigterm_and_time(route: LocalRoute, stage: int, timeout: float = 30.0) -> tuple[int, float]:
    """SIGTERM one worker of the route; (exit code, seconds until it exited)."""
    p = route.procs[stage]
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    rc = p.wait(timeout)
    return rc, time.monotonic() - t0


def sigstop(route: LocalRoute, stage: int) -> None:
    os.kill(route.procs[stage].pid, signal.SIGSTOP)


def sigcont(route: LocalRoute, stage: int) -> None:
    if route.procs[stage].poll() is None:
        os.kill(route.procs[stage].pid, signal.SIGCONT)


def make_ca(directory: Path, members: list[str], *, host: str = "127.0.0.1") -> dict[str, wtls.TlsConfig]:
    """A CA in `directory` and one certificate per member name (valid for `host`), as TlsConfigs with the CA."""
    from dgr.app import certs
    certs.init(directory)
    ca = Path(directory) / certs.CA_CERT
    out = {}
    for name in members:
        cert, key = certs.issue(directory, name, [host])
        out[name] = wtls.TlsConfig(cert, key, ca)
    return out


def tls_flags(cfg: wtls.TlsConfig, mutual: bool = True) -> list[str]:
    flags = ["--tls-cert", str(cfg.cert), "--tls-key", str(cfg.key)]
    return flags + (["--tls-ca", str(cfg.ca)] if mutual and cfg.ca else [])


# A raw Frames stream as a peer holding a certificate: support.wire.RawStream(address, tls).
