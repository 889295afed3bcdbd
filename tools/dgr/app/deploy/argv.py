"""A worker's command line, one builder for every way dgr starts one: `dgr up` (`dgr worker serve ...`), the
systemd units and the Kubernetes pods (`<prefix>/bin/dgr-worker serve ...`). Where a worker runs elsewhere
(its TLS files handed over as credentials or mounted from a Secret, a pod's wildcard address) the caller
says what differs there; the flags themselves come from the deployment file, here alone.
"""

from __future__ import annotations

from pathlib import Path

from dgr.app.deploy.plan import Plan, WorkerPlan


def tls_files(plan: Plan, w: WorkerPlan) -> dict[str, Path]:
    """Worker `w`'s TLS flags and the files of the deployment's tls.dir they name (none without [tls];
    no --tls-ca without mutual TLS)."""
    t = plan.loaded.deployment.tls
    if t is None:
        return {}
    d = plan.loaded.resolve(t.dir)
    files = {"--tls-cert": d / f"{w.name}.pem", "--tls-key": d / f"{w.name}.key"}
    return files | ({"--tls-ca": d / "ca.pem"} if t.mutual else {})


def worker_args(plan: Plan, w: WorkerPlan, bundle: Path | str, port: int, *, bind: str | None = None,
                tls: dict[str, str] | None = None, insecure: bool | None = None) -> list[str]:
    """The `worker serve ...` arguments of worker `w`: the same for `dgr up`, the systemd units and the
    Kubernetes pods. Where the worker runs elsewhere, `bind` (default: the host's), `tls` (flag -> the
    file as the worker sees it, for the flags `tls_files` gives; default: those files) and `insecure`
    (default: the file's worker.insecure) say what differs there."""
    o = plan.loaded.deployment.worker
    bind = bind or w.bind
    listen = f"[{bind}]:{port}" if ":" in bind else f"{bind}:{port}"
    files = tls_files(plan, w)
    if tls is not None and set(tls) != set(files):
        raise ValueError(f"worker_args: tls gives {sorted(tls)}, the deployment's TLS flags are {sorted(files)}")
    paths = tls if tls is not None else {flag: str(f) for flag, f in files.items()}
    args = ["serve", "--bundle", str(bundle), "--stage", str(w.stage), "--listen", listen,
            "--lane", w.host.lane, "--threads", str(o.threads), "--session-ttl", f"{o.session_ttl:g}",
            "--max-sessions", str(o.max_sessions), "--n-ctx", str(o.n_ctx),
            "--max-queued-steps", str(o.max_queued_steps), "--max-session-steps", str(o.max_session_steps),
            "--drain-timeout", f"{o.drain_timeout:g}", "--prefix-cache-mib", str(o.prefix_cache_mib),
            *(a for flag in files for a in (flag, paths[flag]))]
    return args + (["--insecure"] if (o.insecure if insecure is None else insecure) else [])
