"""`dgr up`, `dgr down`, `dgr status`: a deployment's local workers brought up supervised, stopped, reported.

`up` plans the file (refusing it with every problem listed), provisions the bundle into each local
store (verifying), fixes the ports (the file's, or free ones for port 0, kept across restarts), writes
the run folder's `run.json`, starts the detached supervisor, and returns once every local worker
answers gRPC health SERVING (or says which did not, with the end of its log, and stops the run).
`down` stops the supervisor (which drains the workers) and then makes sure no process of the run is
left. `status` reads the run folder and asks each worker for its health and load.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dgr.deploy import runstate
from dgr.deploy.local import free_port, port_free
from dgr.deploy.plan import Plan, WorkerPlan, make_plan
from dgr.deploy.spec import DeployError
from dgr.locks import locked
from dgr.log import get_logger

log = get_logger(__name__)


def _tls_args(plan: Plan, w: WorkerPlan) -> list[str]:
    t = plan.loaded.deployment.tls
    if t is None:
        return []
    d = plan.loaded.resolve(t.dir)
    args = ["--tls-cert", str(d / f"{w.name}.pem"), "--tls-key", str(d / f"{w.name}.key")]
    return args + (["--tls-ca", str(d / "ca.pem")] if t.mutual else [])


def worker_args(plan: Plan, w: WorkerPlan, bundle: Path, port: int) -> list[str]:
    """The `worker serve ...` arguments of worker `w` (the same for `dgr up` and the systemd units)."""
    o = plan.loaded.deployment.worker
    bind = w.bind
    listen = f"[{bind}]:{port}" if ":" in bind else f"{bind}:{port}"
    args = ["serve", "--bundle", str(bundle), "--stage", str(w.stage), "--listen", listen,
            "--lane", w.host.lane, "--threads", str(o.threads), "--session-ttl", f"{o.session_ttl:g}",
            "--max-sessions", str(o.max_sessions), "--n-ctx", str(o.n_ctx),
            "--max-queued-steps", str(o.max_queued_steps), "--max-session-steps", str(o.max_session_steps),
            "--drain-timeout", f"{o.drain_timeout:g}", *_tls_args(plan, w)]
    return args + (["--insecure"] if o.insecure else [])


def client_tls(plan_or_run: Plan | dict, worker: str):
    """A TlsConfig for talking to a worker of the run (its own certificate: status runs on its host)."""
    from dgr.wire.tls import TlsConfig

    tls = plan_or_run.get("tls") if isinstance(plan_or_run, dict) else None
    if not tls:
        return None
    d = Path(tls["dir"])
    return TlsConfig.from_args(str(d / f"{worker}.pem"), str(d / f"{worker}.key"),
                               str(d / "ca.pem"))


def health(address: str, tls=None, timeout: float = 2.0) -> str:
    """The standard gRPC health status of a worker: SERVING, NOT_SERVING, ... or UNREACHABLE."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from dgr.wire.tls import channel

    with channel(address, tls) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError:
            return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def describe_load(address: str, tls=None, timeout: float = 2.0) -> dict | None:
    """The load a worker advertises (open sessions, queued steps, cached positions), or None."""
    import grpc

    from dgr.descriptor import Descriptor
    from dgr.wire.gen import stage_pb2 as pb
    from dgr.wire.gen import stage_pb2_grpc as pb_grpc
    from dgr.wire.tls import channel

    with channel(address, tls) as ch:
        try:
            d = pb_grpc.StageStub(ch).Describe(pb.DescribeRequest(), timeout=timeout)
        except grpc.RpcError:
            return None
    if not d.descriptor_json:
        return None
    return Descriptor.model_validate_json(d.descriptor_json).load.model_dump()


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


def up(path: str | Path, *, run_dir: str | Path | None = None, progress: bool = False) -> UpResult:
    t0 = time.monotonic()
    plan = make_plan(path)
    plan.check()
    d = runstate.run_dir(plan.name, run_dir)
    with locked(runstate.lock_path(d)):
        if _running(d):
            raise DeployError(f"{plan.name} is already up (run folder {d}): `dgr status {path}` shows it, "
                              f"`dgr down {path}` stops it")
        left = runstate.kill_all(d, 5.0)      # leftovers of a supervisor that was itself killed
        if left:
            raise DeployError(f"processes {left} of an earlier run of {plan.name} would not stop")
        from dgr.deploy.provision import provision_local

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
            "argv": [sys.executable, "-m", "dgr.cli", "worker",
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
        env = {**os.environ, runstate.RUN_ENV: str(d), "PYTHONUNBUFFERED": "1"}
        with open(d / "logs" / "supervisor.out", "ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "dgr.deploy.supervisor", str(d)],
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        try:
            _wait_serving(d, workers, sup.ready_timeout, proc)
        except BaseException:
            _stop(d, float(plan.loaded.deployment.worker.drain_timeout))
            raise
    return UpResult(d, route, workers, time.monotonic() - t0, t_prov)


def _wait_serving(d: Path, workers: list[dict], timeout: float, sup: subprocess.Popen) -> None:
    run = runstate.read_run(d)
    deadline = time.monotonic() + timeout
    pending = {w["name"]: w for w in workers}
    while pending:
        for name, w in list(pending.items()):
            if health(w["address"], client_tls(run, name), timeout=1.0) == "SERVING":
                del pending[name]
        if not pending:
            return
        if sup.poll() is not None:      # the supervisor itself failed: say why rather than wait out the bound
            tail = (d / "logs" / "supervisor.out").read_text(errors="replace").splitlines()[-15:]
            raise DeployError(f"the supervisor of {run['name']} exited ({sup.returncode}) before the workers "
                              "served:\n    " + "\n    ".join(tail))
        st = runstate.read_state(d)
        if time.monotonic() > deadline or (st and st.get("status") == "down"):
            tails = []
            for name, w in pending.items():
                try:
                    tail = Path(w["log"]).read_text(errors="replace").splitlines()[-15:]
                except OSError:
                    tail = ["(no log)"]
                tails.append(f"{name} ({w['address']}), log {w['log']}:\n    " + "\n    ".join(tail))
            raise DeployError(f"worker(s) {', '.join(pending)} did not answer health SERVING within "
                              f"{timeout:.0f} s; the run is stopped. " + "\n".join(tails))
        time.sleep(0.2)


def _stop(d: Path, drain: float) -> list[int]:
    st = runstate.read_state(d) or {}
    pid = st.get("supervisor_pid")
    if not pid:  # the supervisor may not have written its state yet: find it by its marker
        pid = next(iter(runstate.run_processes(d)), None)
    runstate.signal_ours(pid, d, 15)
    runstate.wait_gone([pid] if pid else [], d, drain + 10.0)
    return runstate.kill_all(d, 5.0)


def down(name_or_path: str | Path, *, run_dir: str | Path | None = None) -> dict:
    from dgr.deploy.spec import load_deployment

    ld = load_deployment(name_or_path)
    d = runstate.run_dir(ld.deployment.name, run_dir)
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


def status(path: str | Path, *, run_dir: str | Path | None = None) -> dict:
    """Each local worker's name, stage, address, pid, health, load and restarts, and the routes."""
    from dgr.deploy.spec import load_deployment

    ld = load_deployment(path)
    d = runstate.run_dir(ld.deployment.name, run_dir)
    run, st = runstate.read_run(d), runstate.read_state(d) or {}
    if run is None:
        return {"name": ld.deployment.name, "up": False, "run_dir": str(d), "workers": [], "routes": []}
    sup_pid = st.get("supervisor_pid")
    up_now = runstate.ours(sup_pid, d)
    out = []
    for w in run["workers"]:
        rec = st.get("workers", {}).get(w["name"], {})
        pid = rec.get("pid")
        tls = client_tls(run, w["name"])
        h = health(w["address"], tls, timeout=1.0) if up_now else "DOWN"
        out.append({"name": w["name"], "stage": w["stage"], "layers": w["layers"], "host": w["host"],
                    "address": w["address"], "pid": pid if runstate.ours(pid, d) else None, "health": h,
                    "restarts": rec.get("restarts", 0), "last_exit": rec.get("last_exit"),
                    "load": describe_load(w["address"], tls, timeout=1.0) if h == "SERVING" else None,
                    "log": w["log"]})
    return {"name": run["name"], "up": up_now, "run_dir": str(d), "supervisor_pid": sup_pid if up_now else None,
            "orphans": [] if up_now else runstate.run_processes(d),
            "bundle_id": run.get("bundle_id"), "workers": out, "remote": run.get("remote", []),
            "routes": [run["route"]] if up_now else []}
