"""Routes on loopback for the demo and the tests: worker processes (one `dgr worker serve` per stage), or
fake-model workers served from this process."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from dgr.errors import WireError

_READY = re.compile(r"serving on (\S+)")


class LocalRoute:
    """Start one worker process per stage; `addresses` is the route. Use as a context manager."""

    def __init__(self, stage_args: list[list[str]], *, timeout: float = 120.0, log_dir: Path | None = None,
                 env: dict[str, str] | None = None):
        self.procs: list[subprocess.Popen] = []
        self.addresses: list[str] = []
        self.logs: list[list[str]] = []
        try:
            for i, extra in enumerate(stage_args):
                cmd = [sys.executable, "-m", "dgr", "worker", "serve", "--listen", "127.0.0.1:0", *extra]
                p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {})})
                self.procs.append(p)
                self.logs.append([])
            for i, p in enumerate(self.procs):
                self.addresses.append(self._wait_ready(i, p, timeout))
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, i: int, p: subprocess.Popen, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        log = self.logs[i]
        while time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                raise WireError(f"worker for stage {i} exited ({p.wait()}) before serving:\n" + "".join(log[-20:]))
            log.append(line)
            m = _READY.search(line)
            if m:
                # keep draining its output so the pipe never fills up
                threading.Thread(target=lambda: [log.append(x) for x in p.stdout], daemon=True).start()
                return m.group(1)
        raise WireError(f"worker for stage {i} did not start within {timeout:.0f} s:\n" + "".join(log[-20:]))

    @property
    def route(self) -> str:
        return ",".join(self.addresses)

    def kill(self, stage: int) -> None:
        """SIGKILL one stage's worker (a crash, not a shutdown)."""
        self.procs[stage].send_signal(signal.SIGKILL)
        self.procs[stage].wait()

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


class InProcessRoute:
    """Workers of a fake model served from this process (real gRPC over loopback, milliseconds to start).
    `workers[i]` gives tests access to a stage's worker and engine (e.g. to evict a session's cache)."""

    def __init__(self, specs: list[tuple[str, int]], *, max_message_bytes: int | None = None,
                 wire_dtype: str = "f32"):
        from dgr.app import stages
        from dgr.wire import codec
        from dgr.wire.worker import serve

        self.servers, self.workers, self.addresses = [], [], []
        for spec, stage in specs:
            engine, ident = stages.fake_stage(spec, stage, wire_dtype)
            server, worker, address = serve(engine, ident, "127.0.0.1:0", max_message_bytes=max_message_bytes
                                            or codec.DEFAULT_MAX_MESSAGE_BYTES, threads=32)
            self.servers.append(server)
            self.workers.append(worker)
            self.addresses.append(address)

    @classmethod
    def of(cls, spec: str, **kw) -> InProcessRoute:
        """Every stage of one fake model, in order."""
        from dgr.testing.fake_engine import FakeModel

        return cls([(spec, i) for i in range(len(FakeModel.from_spec(spec).ranges))], **kw)

    @property
    def route(self) -> str:
        return ",".join(self.addresses)

    def stop(self) -> None:
        for worker, server in zip(self.workers, self.servers):
            worker.stop()
            server.stop(0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
