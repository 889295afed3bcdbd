"""The supervisor of a run: starts its local workers, restarts a crashed one with backoff, stops them all.

Run detached by `dgr up` as `python -m dgr.deploy.supervisor RUN_DIR` (its own session, so a closed
terminal does not end it). It reads `run.json`, starts every worker with its output appended to
`logs/<worker>.log`, and polls: a worker that exits while the run is up is restarted at the same
address after a backoff that doubles with each quick crash (`supervise.backoff` up to
`supervise.max_backoff`; a worker that ran `supervise.stable_after` seconds starts over), and the
restart is counted and recorded in `state.json` and `logs/supervisor.log`. SIGTERM (`dgr down`) sends
SIGTERM to every worker (they drain), waits their drain bound, SIGKILLs what is left, and exits.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from dgr.deploy.runstate import RUN_ENV, read_run, write_json


def _now() -> float:
    return round(time.time(), 3)


class _Worker:
    def __init__(self, spec: dict, env: dict[str, str]):
        self.spec, self.env = spec, env
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        self.restarts = 0
        self.fails = 0                     # quick crashes in a row: the backoff's exponent
        self.next_start: float | None = 0.0
        self.last_exit: dict | None = None

    @property
    def name(self) -> str:
        return self.spec["name"]

    def start(self) -> None:
        with open(self.spec["log"], "ab") as log:
            log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} supervisor: starting {self.name} "
                      f"(start {self.restarts + 1})\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.spec["argv"], stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=self.env)
        self.started, self.next_start = time.monotonic(), None

    def record(self) -> dict:
        return {"pid": self.proc.pid if self.proc and self.proc.poll() is None else None,
                "restarts": self.restarts, "last_exit": self.last_exit,
                "restart_pending": self.next_start is not None and self.restarts > 0}


class Supervisor:
    def __init__(self, d: Path):
        self.dir = d
        self.run = read_run(d)
        if self.run is None:
            raise SystemExit(f"{d}/run.json is missing: start a deployment with `dgr up FILE`")
        sup = self.run["supervise"]
        self.backoff, self.max_backoff, self.stable = sup["backoff"], sup["max_backoff"], sup["stable_after"]
        self.drain = float(self.run["drain_timeout"])
        env = {**os.environ, RUN_ENV: str(d), "PYTHONUNBUFFERED": "1"}
        self.workers = [_Worker(w, env) for w in self.run["workers"]]
        self.stopping = threading.Event()
        self.log = open(d / "logs" / "supervisor.log", "a", buffering=1)

    def say(self, msg: str) -> None:
        self.log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {msg}\n")

    def save(self, status: str) -> None:
        write_json(self.dir / "state.json", {
            "supervisor_pid": os.getpid(), "status": status, "updated": _now(),
            "workers": {w.name: w.record() for w in self.workers}})

    def loop(self) -> None:
        self.say(f"supervising {len(self.workers)} worker(s) of {self.run['name']}")
        for w in self.workers:
            w.start()
        self.save("up")
        while not self.stopping.is_set():
            changed = False
            for w in self.workers:
                if w.proc is not None and w.next_start is None and w.proc.poll() is not None:
                    changed = True
                    self._crashed(w)
                if w.next_start is not None and time.monotonic() >= w.next_start and not self.stopping.is_set():
                    w.restarts += 1
                    w.start()
                    self.say(f"{w.name}: restarted (restart {w.restarts}), pid {w.proc.pid}")
                    changed = True
            if changed:
                self.save("up")
            self.stopping.wait(0.1)
        self.shutdown()

    def _crashed(self, w: _Worker) -> None:
        code = w.proc.returncode
        ran = time.monotonic() - w.started
        how = f"signal {-code} ({signal.Signals(-code).name})" if code < 0 else f"exit code {code}"
        w.fails = 0 if ran >= self.stable else w.fails + 1
        delay = min(self.backoff * 2 ** max(0, w.fails - 1), self.max_backoff)
        w.last_exit = {"code": code, "how": how, "at": _now(), "ran_s": round(ran, 2)}
        w.next_start = time.monotonic() + delay
        self.say(f"{w.name}: exited with {how} after {ran:.1f} s; restarting in {delay:.2f} s "
                 f"(see {w.spec['log']})")

    def shutdown(self) -> None:
        self.say("stopping: SIGTERM to every worker")
        self.save("stopping")
        live = [w.proc for w in self.workers if w.proc is not None and w.proc.poll() is None]
        for p in live:
            p.send_signal(signal.SIGCONT)      # a stopped worker cannot act on SIGTERM
            p.terminate()
        deadline = time.monotonic() + self.drain + 3.0
        for p in live:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.say(f"pid {p.pid} did not drain within {self.drain + 3:.0f} s: SIGKILL")
                p.kill()
                p.wait()
        for w in self.workers:
            w.next_start = None
        self.save("down")
        self.say("stopped")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m dgr.deploy.supervisor RUN_DIR (started by `dgr up`)", file=sys.stderr)
        return 2
    sup = Supervisor(Path(args[0]).resolve())
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: sup.stopping.set())
    sup.loop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
