"""Routes on loopback for the demo and the tests: worker processes (one `dgr worker serve` per stage and
replica, which tests can kill, stop, resume and restart in place), or fake-model dgr-worker processes
(`FakeRoute`: started directly, milliseconds each)."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from dgr.app.workerbin import worker_binary
from dgr.core.errors import WireError
from dgr.runtime.wire.limits import Limits
from dgr.testing import fake_engine
from dgr.testing.fake_engine import FakeModel
from dgr.toolchain.enginebuild import ensure_engine

_READY = re.compile(r"serving on (\S+)")


class _Worker:
    """One `dgr worker serve` process: its arguments, its output so far, the address it serves on."""

    def __init__(self, stage: int, replica: int, args: list[str], env: dict[str, str] | None):
        self.stage, self.replica, self.args, self.env = stage, replica, list(args), env
        self.proc: subprocess.Popen | None = None
        self.log: list[str] = []
        self.address = ""

    @property
    def name(self) -> str:
        return f"stage {self.stage}" + (f" replica {self.replica}" if self.replica else "")

    def start(self, listen: str = "127.0.0.1:0") -> None:
        cmd = [sys.executable, "-m", "dgr", "worker", "serve", "--listen", listen, *self.args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(self.env or {})})

    def wait_ready(self, timeout: float) -> str:
        p, log = self.proc, self.log
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                raise WireError(f"worker for {self.name} exited ({p.wait()}) before serving:\n" + "".join(log[-20:]))
            log.append(line)
            m = _READY.search(line)
            if m:
                # keep draining its output so the pipe never fills up
                threading.Thread(target=lambda: [log.append(x) for x in p.stdout], daemon=True).start()
                self.address = m.group(1)
                return self.address
        raise WireError(f"worker for {self.name} did not start within {timeout:.0f} s:\n" + "".join(log[-20:]))

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)


class LocalRoute:
    """Start one worker process per stage (and per replica); `addresses` is the route of first
    replicas, `replicas` every stage's addresses, `route` the `--route` text (A,B1|B2,C). Use as a
    context manager. `stage_args[i]`: arguments of stage i's workers; `extra`: arguments for every
    worker, or a function (stage, replica) -> arguments (TLS files, --session-ttl, ...)."""

    worker_class = _Worker

    def __init__(self, stage_args: list[list[str]], *, timeout: float = 120.0, log_dir: Path | None = None,
                 env: dict[str, str] | None = None, replicas: int | list[int] = 1,
                 extra: list[str] | Callable[[int, int], list[str]] | None = None):
        counts = [replicas] * len(stage_args) if isinstance(replicas, int) else list(replicas)
        self.timeout = timeout
        self.workers: list[list[_Worker]] = []
        for i, args in enumerate(stage_args):
            row = []
            for k in range(counts[i]):
                more = extra(i, k) if callable(extra) else list(extra or [])
                row.append(self.worker_class(i, k, [*args, *more], env))
            self.workers.append(row)
        try:
            for w in self.all:
                w.start()
            for w in self.all:
                w.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    @property
    def all(self) -> list[_Worker]:
        return [w for row in self.workers for w in row]

    @property
    def procs(self) -> list[subprocess.Popen]:
        return [row[0].proc for row in self.workers]

    @property
    def logs(self) -> list[list[str]]:
        return [row[0].log for row in self.workers]

    @property
    def addresses(self) -> list[str]:
        return [row[0].address for row in self.workers]

    @property
    def replicas(self) -> list[list[str]]:
        return [[w.address for w in row] for row in self.workers]

    @property
    def route(self) -> str:
        return ",".join("|".join(r) for r in self.replicas)

    def kill(self, stage: int, replica: int = 0) -> None:
        """SIGKILL one worker (a crash, not a shutdown)."""
        w = self.workers[stage][replica]
        w.signal(signal.SIGKILL)
        w.proc.wait()

    def pause(self, stage: int, replica: int = 0) -> None:
        """SIGSTOP one worker: it keeps its sockets but answers nothing."""
        self.workers[stage][replica].signal(signal.SIGSTOP)

    def resume(self, stage: int, replica: int = 0) -> None:
        self.workers[stage][replica].signal(signal.SIGCONT)

    def restart(self, stage: int, replica: int = 0) -> str:
        """Kill -9 one worker and start it again at the same address (an empty worker, restarted in
        place); returns once it serves."""
        w = self.workers[stage][replica]
        self.kill(stage, replica)
        port = w.address.rpartition(":")[2]
        w.log.append(f"--- restarted in place on 127.0.0.1:{port}\n")
        deadline = time.monotonic() + 10
        while True:                                     # the port frees as soon as the process is gone
            w.start(f"127.0.0.1:{port}")
            try:
                return w.wait_ready(self.timeout)
            except WireError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self) -> None:
        for w in self.all:
            if w.proc is not None and w.proc.poll() is None:
                w.signal(signal.SIGCONT)                # a stopped worker cannot act on SIGTERM
                w.proc.terminate()
        for w in self.all:
            if w.proc is None:
                continue
            try:
                w.proc.wait(10)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.stop()
        if exc_type is not None and not issubclass(exc_type, (KeyboardInterrupt, GeneratorExit)):
            self.dump_logs()

    def dump_logs(self, lines: int = 40, out=None) -> None:
        """The last `lines` lines of every worker's output to stderr (what a failed test shows: which
        worker died, refused or reaped what)."""
        out = out or sys.stderr
        for w in self.all:
            out.write(f"----- {w.name} ({w.address or 'not serving'}): last {lines} lines -----\n")
            out.write("".join(w.log[-lines:]))
        out.flush()


class _FakeWorker(_Worker):
    """One `dgr-worker --fake-engine` process, started directly (no Python front end: it serves in
    milliseconds rather than the ~0.4 s of `dgr worker serve`)."""

    def start(self, listen: str = "127.0.0.1:0") -> None:
        env = {**os.environ, **(self.env or {}), fake_engine.LIB_ENV: str(fake_engine.library_path())}
        cmd = [str(worker_binary()), "--listen", listen, *self.args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


# dgr.runtime.wire.limits.Limits field -> the dgr-worker flag that sets it
_LIMIT_FLAGS = {
    "max_batch_tokens": "--max-batch-tokens", "max_batch_sessions": "--max-batch-sessions",
    "hold_batch": "--hold-batch", "die_at": "--test-die-at", "max_queued_steps": "--max-queued-steps",
    "max_session_steps": "--max-session-steps", "session_ttl_s": "--session-ttl", "rpc_timeout_s": "--rpc-timeout",
    "drain_timeout_s": "--drain-timeout", "link_keepalive_timeout_s": "--link-keepalive-timeout",
    "prefix_cache_mib": "--prefix-cache-mib", "draft_max": "--draft-max",
}


def limit_flags(limits) -> list[str]:
    """A `dgr.runtime.wire.limits.Limits` as dgr-worker flags (the fields that differ from the defaults); a field that
    has no flag is refused, never dropped."""
    out: list[str] = []
    if limits is None:
        return out
    default = Limits()
    for f in dataclasses.fields(limits):
        value = getattr(limits, f.name)
        if value == getattr(default, f.name):
            continue
        flag = _LIMIT_FLAGS.get(f.name)
        if flag is None:
            raise ValueError(f"Limits.{f.name} has no dgr-worker flag: a fake route cannot set it")
        if f.name == "die_at":
            for sid, epoch, pos in value:
                out += [flag, f"{sid}:{epoch}:{pos}"]
        else:
            out += [flag, repr(value) if isinstance(value, float) else str(value)]
    return out


class FakeRoute(LocalRoute):
    """A route of fake-model dgr-worker processes on loopback (`dgr-worker --fake-engine SPEC --stage N`, one
    per entry of `specs`, in order; a few milliseconds each to start). Tests kill, stop and restart them as
    any `LocalRoute`'s; `limits` (dgr.runtime.wire.limits.Limits) becomes dgr-worker flags, and `extra` is more of
    them, for every worker or per (stage, replica) as `LocalRoute`'s."""

    worker_class = _FakeWorker

    def __init__(self, specs: list[tuple[str, int]], *, max_message_bytes: int | None = None,
                 wire_dtype: str = "f32", limits=None,
                 extra: list[str] | Callable[[int, int], list[str]] | None = None, timeout: float = 60.0,
                 replicas: int | list[int] = 1, env: dict[str, str] | None = None):
        flags = ["--wire-dtype", wire_dtype, *limit_flags(limits)]
        if max_message_bytes is not None:
            flags += ["--max-message-bytes", str(max_message_bytes)]
        super().__init__([["--fake-engine", spec, "--stage", str(stage), *flags] for spec, stage in specs],
                         timeout=timeout, extra=extra, replicas=replicas, env=env)

    @classmethod
    def of(cls, spec: str, **kw) -> FakeRoute:
        """Every stage of one fake model, in order."""
        return cls([(spec, i) for i in range(len(FakeModel.from_spec(spec).ranges))], **kw)


def engine_library(lib: str | Path | None = None) -> Path:
    """The engine library local routes and benchmarks use: `lib` if given, else `$DGR_ENGINE_LIB` (tests,
    Bazel, a copy of a library another build may relink), else the workspace's CPU build (built if missing)."""
    if lib:
        return Path(lib)
    if os.environ.get("DGR_ENGINE_LIB"):
        return Path(os.environ["DGR_ENGINE_LIB"])

    return ensure_engine("cpu")
