"""The supervisor of a run: starts its local workers, restarts a crashed one with backoff, stops them all.

Run detached by `dgr up` as `python -m dgr.app.deploy.supervisor RUN_DIR` (its own session, so a closed
terminal does not end it). It reads `run.json`, starts every worker with its output appended to
`logs/<worker>.log`, and polls: a worker that exits while the run is up is restarted at the same
address after a backoff that doubles with each quick crash (`supervise.backoff` up to
`supervise.max_backoff`; a worker that ran `supervise.stable_after` seconds starts over), and the
restart is counted and recorded in `state.json` and `logs/supervisor.log`, with the last line the
worker wrote (usually why it exited). A worker that crashed `supervise.give_up_after` times in a row the
same way (the same exit and the same last log line, numbers aside, each within `stable_after` of its
start) is given up on: it is not restarted again and `state.json` carries its error. When every worker
is given up on, nothing is left to supervise: the supervisor records `failed` and exits.
SIGTERM (`dgr down`) sends SIGTERM to every worker (they drain), waits their drain bound, SIGKILLs what
is left, and exits.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from dgr.app.deploy.runstate import RUN_ENV, last_log_line, read_run, start_mark, write_json


def _now() -> float:
    return round(time.time(), 3)


def _same_way(how: str, line: str | None) -> tuple[str, str]:
    """What makes two crashes "the same way": the exit, and the last log line with its numbers (times,
    pids, ports) left out."""
    return how, re.sub(r"\d+", "#", line or "")


def _how(code: int) -> str:
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"signal {-code} ({signal.Signals(-code).name})"
    except ValueError:                     # a real-time signal has no name of its own
        return f"signal {-code}"


class _Worker:
    def __init__(self, spec: dict, env: dict[str, str]):
        self.spec, self.env = spec, env
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        self.restarts = 0
        self.exits = 0
        self.fails = 0                     # quick crashes in a row: the backoff's exponent
        self.same = 0                      # crashes in a row the same way (quick ones after the first)
        self.way: tuple[str, str] | None = None
        self.next_start: float | None = 0.0
        self.restart_at: float | None = None
        self.last_exit: dict | None = None
        self.gave_up = False

    @property
    def name(self) -> str:
        return self.spec["name"]

    def start(self) -> None:
        with open(self.spec["log"], "ab") as log:
            log.write(start_mark(self.name, self.restarts + 1).encode())
            log.flush()
            self.proc = subprocess.Popen(self.spec["argv"], stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=self.env)
        self.started, self.next_start, self.restart_at = time.monotonic(), None, None

    def record(self) -> dict:
        return {"pid": self.proc.pid if self.proc and self.proc.poll() is None else None,
                "restarts": self.restarts, "exits": self.exits, "last_exit": self.last_exit,
                "restart_pending": self.next_start is not None and self.exits > 0,
                "restart_at": self.restart_at, "same_in_a_row": self.same, "gave_up": self.gave_up}


class Supervisor:
    def __init__(self, d: Path):
        self.dir = d
        self.run = read_run(d)
        if self.run is None:
            raise SystemExit(f"{d}/run.json is missing: start a deployment with `dgr up FILE`")
        sup = self.run["supervise"]
        self.backoff, self.max_backoff, self.stable = sup["backoff"], sup["max_backoff"], sup["stable_after"]
        self.give_up_after = int(sup.get("give_up_after", 0))
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
            "give_up_after": self.give_up_after,
            "workers": {w.name: w.record() for w in self.workers}})

    def loop(self) -> None:
        self.say(f"supervising {len(self.workers)} worker(s) of {self.run['name']}")
        for w in self.workers:
            w.start()
        self.save("up")
        while not self.stopping.is_set():
            changed = False
            for w in self.workers:
                if w.proc is not None and w.proc.poll() is not None:
                    changed = True
                    self._crashed(w)
                    w.proc = None
                if w.next_start is not None and time.monotonic() >= w.next_start and not self.stopping.is_set():
                    w.restarts += 1
                    w.start()
                    self.say(f"{w.name}: restarted (restart {w.restarts}), pid {w.proc.pid}")
                    changed = True
            if all(w.gave_up for w in self.workers):
                self.say("every worker was given up on: nothing is left to supervise")
                self.shutdown("failed")
                return
            if changed:
                self.save("up")
            self.stopping.wait(0.1)
        self.shutdown("down")

    def _crashed(self, w: _Worker) -> None:
        code = w.proc.returncode
        ran = time.monotonic() - w.started
        how = _how(code)
        line = last_log_line(w.spec["log"])
        way = _same_way(how, line)
        quick = ran < self.stable
        w.same = w.same + 1 if quick and way == w.way else 1
        w.way = way
        w.fails = w.fails + 1 if quick else 0
        w.exits += 1
        w.last_exit = {"code": code, "how": how, "at": _now(), "ran_s": round(ran, 2), "last_line": line,
                       "restart_in_s": None}
        said = f"{w.name}: exited with {how} after {ran:.1f} s"
        last = f"; its last log line: {line}" if line else "; it wrote nothing to its log"
        if self.give_up_after and w.same >= self.give_up_after:
            w.gave_up, w.next_start, w.restart_at = True, None, None
            self.say(f"{said}, {w.same} times in a row the same way: not restarting it "
                     f"(supervise.give_up_after = {self.give_up_after}; see {w.spec['log']}){last}")
            return
        delay = min(self.backoff * 2 ** max(0, w.fails - 1), self.max_backoff)
        w.next_start, w.restart_at = time.monotonic() + delay, _now() + delay
        w.last_exit["restart_in_s"] = round(delay, 3)
        self.say(f"{said}; restarting in {delay:.2f} s (see {w.spec['log']}){last}")

    def shutdown(self, status: str = "down") -> None:
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
            w.next_start = w.restart_at = None
        self.save(status)
        self.say("stopped")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m dgr.app.deploy.supervisor RUN_DIR (started by `dgr up`)", file=sys.stderr)
        return 2
    sup = Supervisor(Path(args[0]).resolve())
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: sup.stopping.set())
    sup.loop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
