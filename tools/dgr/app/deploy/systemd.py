"""`dgr deploy render FILE --systemd DIR`: one systemd service per worker, plus a target that groups them.

Each unit runs the release's worker (`<prefix>/bin/dgr-worker serve ...`, a release extracted at
`--prefix`, default /opt/dgr) with the same flags `dgr up` gives, restarts on failure, stops with
SIGTERM within the drain bound, and runs as a dynamic user with no access to home directories
(`ProtectHome`: models live in stores on data drives), a read-only system, a private /tmp, and limits
on memory (the host's capacity shared among its workers plus headroom for KV and compute, or without a
capacity `Plan.memory_estimate`: the stage's weights, its prefix cache and that headroom), open files
and tasks. TLS keys reach the unprivileged user through `LoadCredential`.
The worker's own state (resumable verification) goes to its `StateDirectory`.
"""

from __future__ import annotations

from pathlib import Path

from dgr.app.deploy.argv import tls_files, worker_args
from dgr.app.deploy.plan import MEMORY_HEADROOM, Plan, WorkerPlan
from dgr.app.deploy.spec import DeployError

DEFAULT_PREFIX = "/opt/dgr"
# the credential each TLS flag's file is loaded as (the worker reads it at %d/<name>)
_CREDENTIALS = {"--tls-cert": "tls.pem", "--tls-key": "tls.key", "--tls-ca": "ca.pem"}


def unit_name(plan: Plan, w: WorkerPlan) -> str:
    return f"dgr-{plan.name}-{w.name}.service"


def target_name(plan: Plan) -> str:
    return f"dgr-{plan.name}.target"


def _quote(arg: str) -> str:
    """One ExecStart argument: systemd splits on whitespace and expands % and $; quote and escape."""
    a = arg.replace("%", "%%").replace("$", "$$")
    if any(c in a for c in " \t\"'\\;"):
        a = '"' + a.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return a


def _memory_max(plan: Plan, w: WorkerPlan) -> int:
    cap = w.host.capacity.memory
    if cap is not None:
        n = sum(1 for x in plan.workers if x.host.name == w.host.name)
        return int(cap) // n + MEMORY_HEADROOM
    return plan.memory_estimate(w)


def hardening(*, read_only: str | None, lane: str, memory_max: int | None) -> list[str]:
    """A worker service's sandbox and limits: the rendered units' and the Debian package's unit template's
    (dgr.app.deploy.debian), which has no bundle path or memory bound of its own to give (None)."""
    return [
        "ProtectHome=yes",
        "ProtectSystem=strict",
        *([f"ReadOnlyPaths={read_only}"] if read_only else []),
        "PrivateTmp=yes",
        "PrivateDevices=yes" if lane == "cpu" else "# devices stay visible: the lane's GPU",
        "NoNewPrivileges=yes",
        "ProtectKernelTunables=yes",
        "ProtectControlGroups=yes",
        *([f"MemoryMax={memory_max}"] if memory_max else []),
        "LimitNOFILE=65536",
        "LimitCORE=0",
        "TasksMax=512",
    ]


RESTART = ["Restart=on-failure", "RestartSec=2", "KillSignal=SIGTERM"]


def render_unit(plan: Plan, w: WorkerPlan, prefix: str = DEFAULT_PREFIX) -> str:
    info = plan.bundle
    if not w.port:
        raise DeployError(f"worker {w.name}: a unit needs a fixed port; give stages[...].port for stage {w.stage} "
                          "(port 0 is picked by `dgr up` alone)")
    bundle = info.folder_in(w.store)
    if bundle is None:
        raise DeployError(f"{info.label}: its id is not known yet (the units name the bundle folder "
                          f"<store>/<name>-<id12>): build it first (`dgr recipe build {info.recipe_path} --store "
                          f"{w.store}`, or `dgr up`), or give bundle.id")
    # the key is readable by root alone; systemd hands a copy to the dynamic user at %d/<name>
    files = tls_files(plan, w)
    creds = [f"LoadCredential={_CREDENTIALS[flag]}:{path}" for flag, path in files.items()]
    args = worker_args(plan, w, bundle, w.port, tls={flag: f"%d/{_CREDENTIALS[flag]}" for flag in files})
    exec_start = " ".join([_quote(f"{prefix}/bin/dgr-worker")] +
                          [a if a.startswith("%d/") else _quote(a) for a in args])
    state = f"dgr-{plan.name}-{w.name}"
    o = plan.loaded.deployment.worker
    lines = [
        f"# Rendered by `dgr deploy render {plan.loaded.path} --systemd`: edit the deployment file, not this.",
        "[Unit]",
        f"Description=dgr worker {w.name} of {plan.name}: stage {w.stage}, layers [{w.layers[0]}, {w.layers[1]}) "
        f"of bundle {(info.id or '')[:12]}",
        "After=network-online.target",
        "Wants=network-online.target",
        f"PartOf={target_name(plan)}",
        "",
        "[Service]",
        "Type=simple",
        f"ExecStart={exec_start}",
        "Environment=PYTHONUNBUFFERED=1",
        f"Environment=DGR_WORKSPACE=%S/{state}",
        f"StateDirectory={state}",
        *creds,
        *RESTART,
        f"TimeoutStopSec={int(o.drain_timeout) + 5}",
        "DynamicUser=yes",
        *hardening(read_only=_quote(str(bundle)), lane=w.host.lane, memory_max=_memory_max(plan, w)),
        "",
        "[Install]",
        f"WantedBy={target_name(plan)}",
        "",
    ]
    return "\n".join(lines)


def render_target(plan: Plan, units: list[str]) -> str:
    return "\n".join([
        f"# Rendered by `dgr deploy render {plan.loaded.path} --systemd`: all workers of {plan.name} on this host.",
        "[Unit]",
        f"Description=dgr deployment {plan.name} ({len(units)} worker(s))",
        f"Wants={' '.join(units)}",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ])


def render(plan: Plan, out: Path, *, prefix: str = DEFAULT_PREFIX, host: str | None = None) -> list[Path]:
    """Write the units of the workers (of `host`, else every host's) into `out`; returns the files."""
    plan.check()
    ws = [w for w in plan.workers if host is None or w.host.name == host]
    if not ws:
        names = ", ".join(h.name for h in plan.loaded.deployment.hosts)
        raise DeployError(f"--host {host}: no workers there; the file's hosts are {names}")
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for w in ws:
        p = out / unit_name(plan, w)
        p.write_text(render_unit(plan, w, prefix))
        files.append(p)
    t = out / target_name(plan)
    t.write_text(render_target(plan, [f.name for f in files]))
    return [*files, t]
