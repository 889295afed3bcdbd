"""`dgr up`, `dgr down`, `dgr status`: a deployment's local workers brought up supervised, stopped, reported.

`up` plans the file (refusing it with every problem listed), checks that the workers' engine library is
there and loads and that there is a dgr-worker (`_check_engine`: saying why not before starting anything),
provisions the bundle into each local store (verifying), fixes the ports (the file's, or free
ones for port 0, kept across restarts), writes the run folder's `run.json`, starts the detached
supervisor, and returns once every local worker answers gRPC health SERVING. While it waits it reports
each worker that serves and each exit of one (with its last log line); it fails, stopping the run, as
soon as the supervisor gives up on a worker (`supervise.give_up_after` crashes in a row the same way),
when the supervisor exits, or at the ready timeout. `follow` keeps `dgr up --foreground` reporting
afterwards. A signal to `dgr up` (SIGINT, SIGTERM, SIGHUP) stops what it started (`StopSignals`).
`down` stops the supervisor (which drains the workers) and then makes sure no process of the run is
left. `down` and `status` act on the run folder the latest `up` of the deployment used, unless given one
(`runstate.find_run_dir`). `status` reads the run folder, asks each worker for its health and load, and
says whether each worker, each route and the run is up, degraded or down (`dgr.app.deploy.condition`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dgr.app.deploy import STATUS_TIMEOUT_S, condition, runstate
from dgr.app.deploy.argv import worker_args
from dgr.app.deploy.events import Watcher
from dgr.app.deploy.local import free_port, port_free
from dgr.app.deploy.plan import Plan, make_plan
from dgr.app.deploy.provision import provision_local
from dgr.app.deploy.spec import DeployError, load_deployment
from dgr.app.workerbin import worker_binary
from dgr.core.descriptor import Descriptor
from dgr.core.errors import DgrError
from dgr.core.locks import locked
from dgr.core.log import get_logger
from dgr.runtime.engine_abi import LIB_ENV, library_path
from dgr.runtime.wire.gen import stage_pb2 as pb, stage_pb2_grpc as pb_grpc
from dgr.runtime.wire.tls import TlsConfig, channel

log = get_logger(__name__)

STILL_WAITING_EVERY_S = 30.0     # how often `dgr up` says whom it still waits for (when nothing else happens)


def _stderr(line: str) -> None:
    print(f"dgr up: {line}", file=sys.stderr, flush=True)


class Interrupted(BaseException):
    """A signal asked `dgr up` to stop (a BaseException, as KeyboardInterrupt: nothing catches it on the way)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """While held, SIGINT, SIGTERM and SIGHUP raise `Interrupted` in the main thread, once: a second
    signal during the clean-up the first one started is ignored, so the clean-up is not cut short. A
    signal this process was told to ignore (`nohup`, a background job's SIGINT) stays ignored."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.armed = True
        self.old: dict[int, object] = {}

    def _handler(self, signum, frame) -> None:
        if self.armed:
            self.armed = False
            raise Interrupted(signum)

    def __enter__(self) -> StopSignals:
        for sig in self.SIGNALS:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                self.old[sig] = signal.signal(sig, self._handler)
        return self

    def release(self) -> None:
        """Back to the handlers before (from here a signal ends this process as it would have)."""
        for sig, old in self.old.items():
            signal.signal(sig, old)
        self.old = {}

    def __exit__(self, *exc) -> None:
        self.release()


def client_tls(plan_or_run: Plan | dict, worker: str):
    """A TlsConfig for talking to a worker of the run (its own certificate: status runs on its host)."""
    tls = plan_or_run.get("tls") if isinstance(plan_or_run, dict) else None
    if not tls:
        return None
    d = Path(tls["dir"])
    return TlsConfig.from_args(str(d / f"{worker}.pem"), str(d / f"{worker}.key"),
                               str(d / "ca.pem"))


def health(address: str, tls=None, timeout: float = 2.0) -> str:
    """The standard gRPC health status of a worker: SERVING, NOT_SERVING, ... or UNREACHABLE."""
    with channel(address, tls) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError:
            return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def describe_load(address: str, tls=None, timeout: float = 2.0) -> dict | None:
    """The load a worker advertises (open sessions, queued steps, cached positions), and why it keeps no
    prefixes (`prefix_cache_off`, "" where it does), or None."""
    with channel(address, tls) as ch:
        try:
            d = pb_grpc.StageStub(ch).Describe(pb.DescribeRequest(), timeout=timeout)
        except grpc.RpcError:
            return None
    if not d.descriptor_json:
        return None
    return {**Descriptor.model_validate_json(d.descriptor_json).load.model_dump(), "prefix_cache_off": d.prefix_cache_off}


@dataclass
class UpResult:
    run_dir: Path
    route: str
    workers: list[dict]
    seconds: float          # from the start of `up` to every local worker SERVING
    provision_seconds: float


def _running(d: Path) -> bool:
    st = runstate.read_state(d)
    return bool(st) and runstate.ours(st.get("supervisor_pid"), d)


# Run in a child process by `_check_engine`: load the engine library as dgr-worker does (dlopen with
# RTLD_NOW, then the C ABI's version and struct sizes) and print why it does not load: dlopen's or dlsym's own
# message. A child, so that a library that crashes its loader (a build for another CPU) takes only the child.
_LOAD_PROBE = """
import ctypes, sys
from pathlib import Path
try:
    h = ctypes.CDLL(sys.argv[1])            # ctypes dlopens with RTLD_NOW, as dgr-worker
except OSError as err:
    sys.exit(f"dlopen: {err}")
from dgr.runtime.engine_abi import check_abi
try:
    check_abi(h, Path(sys.argv[1]))
except AttributeError as err:               # a symbol of the C ABI it lacks (dlsym's message)
    sys.exit(f"dlsym: {err}")
except Exception as err:
    sys.exit(str(err))
"""


def _load_error(path: Path) -> str | None:
    """Why the engine library at `path` does not load in a worker (the loader's own message), or None."""
    try:
        p = subprocess.run([sys.executable, "-c", _LOAD_PROBE, str(path)], stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "loading it did not finish within 120 s"
    if p.returncode == 0:
        return None
    if p.returncode < 0:
        return f"loading it killed the process with {signal.Signals(-p.returncode).name}"
    lines = p.stderr.strip().splitlines()
    return lines[-1] if lines else f"loading it failed (exit code {p.returncode})"


def _check_engine(plan: Plan) -> None:
    """The workers load the engine library `dgr up` would find (they inherit its environment), and run the
    dgr-worker it would find: when the library is missing or does not load, or there is no dgr-worker, none
    of them can start, so say so now (the library, and the loader's message) rather than after their
    restarts."""
    try:
        path = library_path()
    except DgrError as err:
        raise DeployError(f"the workers cannot start: {err}; nothing was started") from None
    lanes = sorted({w.host.lane for w in plan.workers if w.local}) or ["cpu"]
    fix = (f"set {LIB_ENV} to a built libdgr_engine for the {', '.join(lanes)} lane, or unset it to use the "
           f"workspace's (`dgr build-engine --lane {lanes[0]}`); nothing was started")
    if not path.is_file():
        raise DeployError(f"the workers cannot start: engine library {path} does not exist ({LIB_ENV}); {fix}")
    why = _load_error(path)
    if why:
        where = f" ({LIB_ENV})" if os.environ.get(LIB_ENV) else ""
        raise DeployError(f"the workers cannot start: engine library {path}{where} does not load: {why}; {fix}")
    try:
        worker_binary()
    except DgrError as err:
        raise DeployError(f"the workers cannot start: {err}; nothing was started") from None


def up(path: str | Path, *, run_dir: str | Path | None = None, progress: bool = False,
       ready_timeout: float | None = None, say: Callable[[str], None] = _stderr) -> UpResult:
    """Bring the file's local workers up, supervised; `say` gets one line per event while waiting
    (exits, restarts and give-ups always; with `progress`, also each worker SERVING and whom it still
    waits for). Raises DeployError, having stopped the run, when they do not all serve."""
    t0 = time.monotonic()
    plan = make_plan(path)
    plan.check()
    _check_engine(plan)
    d = runstate.run_dir(plan.name, run_dir)
    with locked(runstate.lock_path(d)):
        if _running(d):
            there = "" if runstate.find_run_dir(plan.name) == d else f" --run-dir {d}"
            raise DeployError(f"{plan.name} is already up (run folder {d}): `dgr status {path}{there}` shows it, "
                              f"`dgr down {path}{there}` stops it")
        left = runstate.kill_all(d, 5.0)      # leftovers of a supervisor that was itself killed
        if left:
            raise DeployError(f"processes {left} of an earlier run of {plan.name} would not stop")

        local = [w for w in plan.workers if w.local]
        if not local:
            raise DeployError(f"{path}: none of its hosts is this "
                              "machine; run `dgr up` on the hosts it names")
        folders = provision_local(plan, progress=progress)
        t_prov = time.monotonic() - t0
        ports: dict[str, int] = {}
        for w in plan.workers:
            if w.local:
                p = w.port or free_port(w.bind)
                if w.port and not port_free(w.bind, p):
                    raise DeployError(f"worker {w.name}: port {p} on {w.bind} is in use by another process; "
                                      f"stop it, or give stage {w.stage} another port in {path}")
                ports[w.name] = p
        tls = plan.loaded.deployment.tls
        sup = plan.loaded.deployment.supervise
        workers = [{
            "name": w.name, "stage": w.stage, "layers": list(w.layers), "host": w.host.name,
            "address": w.address(ports[w.name]), "bundle": str(folders[w.store]),
            "argv": [sys.executable, "-m", "dgr.cli.main", "worker",
                     *worker_args(plan, w, folders[w.store], ports[w.name])],
            "log": str(runstate.log_path(d, w.name)),
        } for w in local]
        route = plan.route(ports)
        runstate.write_json(d / "run.json", {
            "name": plan.name, "file": str(plan.loaded.path), "route": route, "workers": workers,
            "remote": [{"name": w.name, "stage": w.stage, "host": w.host.name, "address": w.address()}
                       for w in plan.workers if not w.local],
            "tls": {"dir": str(plan.loaded.resolve(tls.dir))} if tls else None,
            "supervise": sup.model_dump(), "drain_timeout": plan.loaded.deployment.worker.drain_timeout,
            "bundle_id": plan.bundle.id})
        (d / "state.json").unlink(missing_ok=True)
        runstate.record_run_dir(plan.name, d)   # `dgr status` and `dgr down` without --run-dir look here now
        env = {**os.environ, runstate.RUN_ENV: str(d), "PYTHONUNBUFFERED": "1"}
        proc = None
        try:
            with open(d / "logs" / "supervisor.out", "ab") as out:
                proc = subprocess.Popen([sys.executable, "-m", "dgr.app.deploy.supervisor", str(d)],
                                        stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
            _wait_serving(d, path, workers, ready_timeout or sup.ready_timeout, proc, say, progress, t0)
            return UpResult(d, route, workers, time.monotonic() - t0, t_prov)
        except BaseException:
            _stop(d, float(plan.loaded.deployment.worker.drain_timeout), proc)
            raise


def _tail(path: str | Path, n: int = 15) -> list[str]:
    try:
        return Path(path).read_text(errors="replace").splitlines()[-n:] or ["(empty)"]
    except OSError:
        return ["(no log)"]


def _gave_up_error(path, workers: dict[str, dict], names: list[str], st: dict) -> DeployError:
    recs = st.get("workers", {})
    by_line: dict[str, list[str]] = {}
    for n in names:
        by_line.setdefault((recs[n].get("last_exit") or {}).get("last_line") or "", []).append(n)
    parts = []
    for line, ns in by_line.items():
        rec = recs[ns[0]]
        e = rec.get("last_exit") or {}
        logs = ", ".join(workers[n]["log"] for n in ns)
        who = f"worker {ns[0]}" if len(ns) == 1 else f"workers {', '.join(ns)}"
        parts.append(f"{who} will not start: it exited {rec.get('same_in_a_row')} times in a row the same way "
                     f"({e.get('how')}, the last time {e.get('ran_s', 0):.1f} s after starting) and the "
                     f"supervisor gave up on it; its last log line: {line or '(it wrote nothing)'} (log {logs})")
    return DeployError("; ".join(parts) + f". The run is stopped: fix that, then `dgr up {path}` again")


def _still_waiting(pending: dict[str, dict], st: dict) -> str:
    recs = (st or {}).get("workers", {})
    parts = []
    for n in pending:
        r = recs.get(n, {})
        what = ("restart pending" if r.get("restart_pending") else
                f"starting, pid {r['pid']}" if r.get("pid") else "not started yet")
        exits = f", {r['exits']} exit(s) so far" if r.get("exits") else ""
        parts.append(f"{n} ({what}{exits})")
    return ", ".join(parts)


def _wait_serving(d: Path, path, workers: list[dict], timeout: float, sup: subprocess.Popen,
                  say: Callable[[str], None], progress: bool, t0: float) -> None:
    run = runstate.read_run(d)
    start = time.monotonic()
    deadline = start + timeout
    pending = {w["name"]: w for w in workers}
    watch = Watcher()
    if progress:
        say(f"waiting for {len(workers)} worker(s) to answer health SERVING (at most {timeout:g} s: "
            "supervise.ready_timeout, or --ready-timeout)")
    next_note = start + STILL_WAITING_EVERY_S
    while True:
        for name, w in list(pending.items()):
            if health(w["address"], client_tls(run, name), timeout=1.0) == "SERVING":
                del pending[name]
                if progress:
                    say(f"{name} SERVING at {w['address']} ({time.monotonic() - t0:.1f} s)")
        st = runstate.read_state(d) or {}
        for line in watch.changes(st):
            say(line)
        if not pending:
            # one more look at all of them: one that served earlier may have exited since
            pending = {w["name"]: w for w in workers
                       if health(w["address"], client_tls(run, w["name"]), timeout=1.0) != "SERVING"}
            if not pending:
                return
        gave_up = [n for n, r in st.get("workers", {}).items() if r.get("gave_up")]
        if gave_up:
            raise _gave_up_error(path, {w["name"]: w for w in workers}, gave_up, st)
        if sup.poll() is not None:      # the supervisor itself failed: say why rather than wait out the bound
            raise DeployError(f"the supervisor of {run['name']} exited ({sup.returncode}) before the workers "
                              f"served; the end of {d}/logs/supervisor.out:\n    "
                              + "\n    ".join(_tail(d / "logs" / "supervisor.out")))
        if st.get("status") in ("stopping", "down"):
            raise DeployError(f"the supervisor of {run['name']} was told to stop (a SIGTERM from outside) before "
                              "the workers served; the run is stopped")
        if time.monotonic() > deadline:
            tails = [f"{name} ({w['address']}), log {w['log']}:\n    " + "\n    ".join(_tail(w["log"]))
                     for name, w in pending.items()]
            raise DeployError(f"worker(s) {', '.join(pending)} did not answer health SERVING within "
                              f"{timeout:g} s; the run is stopped (a worker that needs longer to load: raise "
                              f"supervise.ready_timeout or pass --ready-timeout). " + "\n".join(tails))
        if progress and time.monotonic() >= next_note:
            say(f"still waiting after {time.monotonic() - start:.0f} s of {timeout:g} s for "
                + _still_waiting(pending, st))
            next_note += STILL_WAITING_EVERY_S
        time.sleep(0.2)


def follow(d: Path, say: Callable[[str], None]) -> str:
    """`dgr up --foreground` after SERVING: report each exit, restart, give-up and return to SERVING of a
    worker until the run stops. Returns how it stopped when that was `dgr down`; raises DeployError when
    the supervisor stopped otherwise (every worker given up on, or it was killed: what is left is
    stopped). A signal is the caller's (`StopSignals`)."""
    run = runstate.read_run(d)
    watch = Watcher(runstate.read_state(d))
    recovering: set[str] = set()
    while True:
        st = runstate.read_state(d) or {}
        recs = st.get("workers", {})
        for name, rec in recs.items():
            if watch.exited_since(st, name) and not rec.get("gave_up"):
                recovering.add(name)            # report it when it serves again
        for line in watch.changes(st):
            say(line)
        recovering -= {n for n, r in recs.items() if r.get("gave_up")}
        for name in sorted(recovering):
            w = next(x for x in run["workers"] if x["name"] == name)
            if health(w["address"], client_tls(run, name), timeout=1.0) == "SERVING":
                recovering.discard(name)
                say(f"{name} SERVING again at {w['address']} (restart {recs.get(name, {}).get('restarts')})")
        if not runstate.ours(st.get("supervisor_pid"), d):
            st = runstate.read_state(d) or {}
            if st.get("status") == "down":
                return "stopped by `dgr down`"
            gave_up = [n for n, r in st.get("workers", {}).items() if r.get("gave_up")]
            left = _stop(d, float(run["drain_timeout"]))
            if st.get("status") == "failed" and gave_up:
                raise DeployError(f"every worker of {run['name']} was given up on: "
                                  + "; ".join(f"{n}: {condition.given_up_why(st['workers'][n])}" for n in gave_up)
                                  + f"; nothing is left running. Fix that, then `dgr up {run['file']}` again")
            raise DeployError(f"the supervisor of {run['name']} is gone (killed?); its workers are stopped"
                              + (f" except {left}" if left else "") + f"; the end of {d}/logs/supervisor.log:\n    "
                              + "\n    ".join(_tail(d / "logs" / "supervisor.log")))
        time.sleep(0.5)


def _stop(d: Path, drain: float, proc: subprocess.Popen | None = None) -> list[int]:
    st = runstate.read_state(d) or {}
    pid = st.get("supervisor_pid") or (proc.pid if proc else None)
    if not pid:  # the supervisor may not have written its state yet: find it by its marker
        pid = next(iter(runstate.run_processes(d)), None)
    runstate.signal_ours(pid, d, 15)
    runstate.wait_gone([pid] if pid else [], d, drain + 10.0)
    left = runstate.kill_all(d, 5.0)
    if proc is not None:            # reap it: `dgr up` is its parent
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5.0)
    return left


def up_run_dir(name_or_path: str | Path, run_dir: str | Path | None = None) -> Path:
    """The run folder `up` uses: `run_dir` (--run-dir), else the default; never the one an earlier `up
    --run-dir` recorded (where `down` and `status` look), which may be another run of the same file."""
    return runstate.run_dir(load_deployment(name_or_path).deployment.name, run_dir)


def down(name_or_path: str | Path, *, run_dir: str | Path | None = None) -> dict:
    ld = load_deployment(name_or_path)
    d = runstate.find_run_dir(ld.deployment.name, run_dir)
    with locked(runstate.lock_path(d)):
        before = runstate.run_processes(d)
        t0 = time.monotonic()
        left = _stop(d, ld.deployment.worker.drain_timeout)
        if left:
            raise DeployError(f"processes {left} of {ld.deployment.name} would not stop (even SIGKILL)")
        st = runstate.read_state(d)
        if st:
            st["status"] = "down"
            runstate.write_json(d / "state.json", st)
        return {"stopped": before, "seconds": time.monotonic() - t0, "run_dir": str(d)}


def status(path: str | Path, *, run_dir: str | Path | None = None, timeout: float = STATUS_TIMEOUT_S) -> dict:
    """Each local worker's name, stage, address, pid, health, load, restarts and condition (up, degraded,
    down, and why), each route's condition, and the run's (`dgr.app.deploy.condition`)."""
    ld = load_deployment(path)
    d = runstate.find_run_dir(ld.deployment.name, run_dir)
    run, st = runstate.read_run(d), runstate.read_state(d) or {}
    if run is None:
        return {"name": ld.deployment.name, "state": condition.DOWN, "up": False, "supervised": False,
                "run_dir": str(d), "supervisor_pid": None, "supervisor_status": None, "orphans": [],
                "bundle_id": None, "workers": [], "remote": [], "routes": [], "route_states": []}
    sup_pid = st.get("supervisor_pid")
    supervised = runstate.ours(sup_pid, d)
    out = []
    for w in run["workers"]:
        rec = st.get("workers", {}).get(w["name"], {})
        pid = rec.get("pid") if runstate.ours(rec.get("pid"), d) else None
        tls = client_tls(run, w["name"])
        h = health(w["address"], tls, timeout=timeout) if supervised else "DOWN"
        state, why = condition.worker({**rec, "pid": pid}, h, supervised)
        out.append({"name": w["name"], "stage": w["stage"], "layers": w["layers"], "host": w["host"],
                    "address": w["address"], "pid": pid, "health": h, "state": state, "why": why,
                    "restarts": rec.get("restarts", 0), "last_exit": rec.get("last_exit"),
                    "gave_up": bool(rec.get("gave_up")),
                    "load": describe_load(w["address"], tls, timeout=timeout) if h == "SERVING" else None,
                    "log": w["log"]})
    routes = [condition.route(run["route"], {w["address"]: w["state"] for w in out})]
    state = condition.run(supervised, [w["state"] for w in out], routes)
    return {"name": run["name"], "state": state, "up": state == condition.UP, "supervised": supervised,
            "run_dir": str(d), "supervisor_pid": sup_pid if supervised else None,
            "supervisor_status": st.get("status"),
            "orphans": [] if supervised else runstate.run_processes(d),
            "bundle_id": run.get("bundle_id"), "workers": out, "remote": run.get("remote", []),
            "routes": [r["route"] for r in routes if r["state"] != condition.DOWN],
            "route_states": routes}
