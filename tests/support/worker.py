"""Helpers for the worker-side tests of bounded resources, drain and TLS: worker processes with extra
flags, raw stubs over plaintext or TLS, sessions opened along a route by hand, and a local CA; and dgr-worker
processes serving stages of a bundle (Proc, cpp, cpp_stages), shared by the tests of tests/worker/."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
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


# dgr-worker processes (worker/server) serving stages of a bundle, read by the tests of tests/worker/.
# Each says `serving on ADDRESS` once it serves.
READY = re.compile(r"serving on (\S+)")


class Proc:
    """A worker process serving one stage; its address once it says so."""

    def __init__(self, cmd: list[str]):
        self.cmd = cmd
        self.t0 = time.monotonic()
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.log: list[str] = []
        self.address = ""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = self.p.stdout.readline()
            if not line:
                raise AssertionError(f"{cmd[0]} exited ({self.p.wait()}) before serving:\n{''.join(self.log)}")
            self.log.append(line)
            if m := READY.search(line):
                self.address = m.group(1)
                break
        assert self.address, f"{cmd} did not serve within 120 s:\n{''.join(self.log)}"
        self.ready_s = time.monotonic() - self.t0
        # keep reading its output: a worker that logs into a full pipe nobody reads blocks there, holding
        # whatever lock it logged under (docs/worker.md "Locks and their order")
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.StageStub(self.channel)

    def _read(self) -> None:
        for line in self.p.stdout:
            self.log.append(line)

    def output(self, timeout: float = 30) -> str:
        """Everything the worker wrote, once it has exited (or `timeout` s after asking)."""
        self._reader.join(timeout)
        return "".join(self.log)

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.p.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0

    def stop(self) -> str:
        self.channel.close()
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        return self.output()


def cpp(worker_bin: Path, bundle: Path, stage: int, *extra: str) -> Proc:
    return Proc([str(worker_bin), "--bundle", str(bundle), "--stage", str(stage), "--listen", "127.0.0.1:0", *extra])


def cpp_stages(worker_bin: Path, bundle: Path, n: int, *extra: str, per_stage=lambda i: ()) -> list[Proc]:
    """Stages 0..n-1 of `bundle` as dgr-workers, each with `extra` and `per_stage(i)` flags; the ones
    started are stopped again when one fails to serve."""
    procs: list[Proc] = []
    try:
        for i in range(n):
            procs.append(cpp(worker_bin, bundle, i, *extra, *per_stage(i)))
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs


def one_line_error(cmd: list[str]) -> tuple[int, str]:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, r.stderr
    return r.returncode, lines[0]


# The tiny route of tests/worker/ (conftest.py's `tiny_route`: a 6-layer llama in 3 stages) as its tests serve
# it (one thread, a 256-token context), and the sampling they draw with.
RANGES = [(0, 2), (2, 4), (4, 6)]
N_CTX = 256
FLAGS = ("--threads", "1", "--n-ctx", str(N_CTX))
SAMPLED = dict(temperature=0.9, top_k=40, top_p=0.95, seed=11)
