"""A deployment's run folder: what to run (`run.json`), what runs (`state.json`), its lock, its logs.

The folder is `<workspace>/deploy/<name>/` (dgr.core.paths; `--run-dir` picks another, and `dgr up --run-dir`
records it there, in `elsewhere.json`, so that `dgr status` and `dgr down` without `--run-dir` find the
run the latest `dgr up` started: `find_run_dir`). `dgr up` writes
`run.json` (every local worker: name, stage, address, command line, log file) and starts the
supervisor; the supervisor alone writes `state.json` (its pid and status, each worker's pid, exits,
restarts, last exit with its last log line, and whether it was given up on), each time atomically, so
readers never see half a file. `dgr up` and `dgr down` hold `lock` (dgr.core.locks)
so two of them never interleave. Every process of a run carries `DGR_DEPLOY_RUN=<folder>` in its
environment: that is how a pid read back from a file is known to still be ours, not a reused one.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from dgr.core.paths import workspace

RUN_ENV = "DGR_DEPLOY_RUN"


def run_dir(name: str, override: str | Path | None = None) -> Path:
    d = Path(override).resolve() if override else default_run_dir(name)
    (d / "logs").mkdir(parents=True, exist_ok=True)
    return d


# In the default folder: the folder the latest `dgr up` of the deployment used, when it was another one.
ELSEWHERE = "elsewhere.json"


def default_run_dir(name: str) -> Path:
    return workspace() / "deploy" / name


def record_run_dir(name: str, d: Path) -> None:
    """Say where the latest `dgr up` of deployment `name` runs: `d`, in the default folder (a `dgr up` into
    the default folder itself removes the record)."""
    home = default_run_dir(name)
    if d.resolve() == home.resolve():
        (home / ELSEWHERE).unlink(missing_ok=True)
        return
    home.mkdir(parents=True, exist_ok=True)
    write_json(home / ELSEWHERE, {"run_dir": str(d), "why": "the run folder of the latest `dgr up --run-dir` "
                                  "of this deployment; `dgr status` and `dgr down` without --run-dir use it"})


def find_run_dir(name: str, override: str | Path | None = None) -> Path:
    """The run folder `dgr status` and `dgr down` act on: `override` (--run-dir) when given, else the one
    the latest `dgr up` of `name` used (`record_run_dir`) while it still holds that run, else the default."""
    if not override:
        rec = (read_json(default_run_dir(name) / ELSEWHERE) or {}).get("run_dir")
        if rec and (Path(rec) / "run.json").is_file():     # (a folder removed since is not made again)
            override = rec
    return run_dir(name, override)


def lock_path(d: Path) -> Path:
    return d / "lock"


def log_path(d: Path, worker: str) -> Path:
    return d / "logs" / f"{worker}.log"


# The supervisor writes this line into a worker's log before each start of it: what follows is that
# start's output.
START_MARK = " supervisor: starting "


def start_mark(worker: str, start: int) -> str:
    return f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}{START_MARK}{worker} (start {start})\n"


def last_log_line(path: str | Path, limit: int = 400) -> str | None:
    """The last non-blank line a worker wrote to its log since its latest start (cut to `limit`
    characters), or None when it wrote nothing since then: the line that usually says why it exited."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            tail = f.read().decode(errors="replace")
    except OSError:
        return None
    for line in reversed(tail.splitlines()):
        line = line.strip()
        if not line:
            continue
        if line.startswith("--- ") and START_MARK in line:
            return None
        return line if len(line) <= limit else line[:limit] + "..."
    return None


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError:
        return None


def read_run(d: Path) -> dict | None:
    return read_json(d / "run.json")


def read_state(d: Path) -> dict | None:
    return read_json(d / "state.json")


def ours(pid: int | None, d: Path) -> bool:
    """Whether `pid` is alive and a process of the run in `d` (its environment says so)."""
    if not pid:
        return False
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    if stat.rpartition(")")[2].split()[0] == "Z":    # a zombie has exited; only its parent's wait is missing
        return False
    return f"{RUN_ENV}={d}".encode() in env.split(b"\0")


def signal_ours(pid: int | None, d: Path, sig: int) -> bool:
    if not ours(pid, d):
        return False
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def wait_gone(pids: list[int], d: Path, timeout: float) -> list[int]:
    """Wait until none of `pids` is a live process of the run; returns those still alive."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if ours(p, d)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def run_processes(d: Path) -> list[int]:
    """Every live process carrying this run's marker (supervisor and workers, even ones no file names)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and int(p.name) != os.getpid() and ours(int(p.name), d):
            out.append(int(p.name))
    return sorted(out)


def kill_all(d: Path, timeout: float) -> list[int]:
    """SIGKILL what is left of the run; returns what would not go."""
    pids = run_processes(d)
    for pid in pids:
        signal_ours(pid, d, signal.SIGKILL)
    return wait_gone(pids, d, timeout)
