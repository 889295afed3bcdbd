"""`dgr deploy plan|render`: what a deployment file puts where, and the systemd units or Kubernetes objects that
run it (dgr.app.deploy). Running it on this machine is `dgr up`, `dgr down` and `dgr status` (their modules)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _plan_json(plan) -> dict:
    info = plan.bundle
    return {
        "name": plan.name, "file": str(plan.loaded.path),
        "bundle": {"label": info.label, "id": info.id, "name": info.name, "stages": [list(r) for r in info.ranges],
                   "copies": {str(k): str(v) for k, v in info.copies.items()}},
        "workers": [{"name": w.name, "stage": w.stage, "layers": list(w.layers), "host": w.host.name,
                     "address": w.address() if w.port else None, "store": str(w.store), "local": w.local}
                    for w in plan.workers],
        "routes": [plan.route()], "todo": plan.todo, "problems": plan.problems,
    }


def _plan(args) -> int:
    # lazy: dgr.app.deploy.plan costs 130 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.app.deploy.plan import make_plan

    plan = make_plan(args.file)
    if args.json:
        print(json.dumps(_plan_json(plan), indent=2))
        return 1 if plan.problems else 0
    info = plan.bundle
    ident = f" ({info.name}-{info.id[:12]})" if info.id else ""
    stages = f"{len(info.ranges)} stage(s)" if info.ranges else "its stages unknown"
    print(f"deployment {plan.name} ({args.file}): {info.label}{ident}, {stages}, {len(plan.workers)} worker(s)")
    for w in plan.workers:
        where = "this machine" if w.local else "another machine"
        addr = w.address() if w.port else f"{w.host.address}:<port at up>"
        wb = f"  {_size(info.weights[w.stage])}" if info.weights and w.stage < len(info.weights) else ""
        print(f"  {w.name:<7} stage {w.stage} [{w.layers[0]}, {w.layers[1]})  on {w.host.name} ({where})  "
              f"{addr}{wb}  store {w.store}")
    for h in plan.loaded.deployment.hosts:
        ws = [w for w in plan.workers if w.host.name == h.name]
        held = sum(info.weights[w.stage] for w in ws) if info.weights and ws else None
        cap = [f"memory {_size(int(h.capacity.memory))}" if h.capacity.memory else "",
               f"{h.capacity.workers} workers" if h.capacity.workers else ""]
        cap_s = ", ".join(c for c in cap if c) or "no limit given"
        print(f"  host {h.name} ({h.address}, {h.lane}): {len(ws)} worker(s)"
              + (f", {_size(held)} of weights" if held is not None else "") + f"; capacity {cap_s}")
    if plan.todo:
        print("missing:")
        for t in plan.todo:
            print(f"  - {t}")
    if plan.workers and not plan.problems:
        print(f"route: {plan.route()}")
        print(f"  dgr generate --route \"{plan.route()}\" \"Hello\"")
    for p in plan.problems:
        print(f"dgr: error: {p}", file=sys.stderr)
    if plan.problems:
        print(f"dgr: {len(plan.problems)} problem(s) in {args.file}; nothing was started", file=sys.stderr)
        return 1
    return 0


def _render(args) -> int:
    # lazy: dgr.app.deploy.plan costs 130 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.app.deploy.plan import make_plan
    from dgr.app.deploy.spec import DeployError

    if args.kubernetes:
        # lazy: dgr.app.deploy.kubernetes costs 133 ms at start-up (python -X importtime, 2026-12-05)
        from dgr.app.deploy import kubernetes

        if args.host:
            raise DeployError("--host goes with --systemd (a Kubernetes render holds every host's workers)")
        plan = make_plan(args.file)
        o = kubernetes.Options.default(args.image, args.tools_image, args.namespace, args.prefix)
        files = kubernetes.render(plan, Path(args.kubernetes), o)
        notes = kubernetes.notes(plan)
    else:
        # lazy: dgr.app.deploy.systemd costs 129 ms at start-up (python -X importtime, 2026-12-05)
        from dgr.app.deploy.systemd import DEFAULT_PREFIX, render

        given = [f for f, v in (("--image", args.image), ("--tools-image", args.tools_image),
                                ("--namespace", args.namespace)) if v]
        if given:
            raise DeployError(f"{', '.join(given)}: for --kubernetes only")
        files = render(make_plan(args.file), Path(args.systemd), prefix=args.prefix or DEFAULT_PREFIX, host=args.host)
        notes = []
    for f in files:
        print(f)
    for note in notes:
        print(f"dgr: note: {note}", file=sys.stderr, flush=True)
    return 0


def register(sub) -> None:
    """Add `dgr deploy` to the `dgr` parser."""
    d = sub.add_parser("deploy", help="deployments: plan a deployment file, render systemd units or Kubernetes "
                       "objects")
    dsub = d.add_subparsers(dest="deploy_command", metavar="ACTION", required=True)
    p = dsub.add_parser("plan", help="what goes where, what is missing, the routes; every problem listed")
    p.add_argument("file", help="a deployment file (TOML; docs/deploy.md)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_plan)
    p = dsub.add_parser("render", help="write one systemd unit per worker (and a target grouping them), or the "
                        "Kubernetes objects of the deployment",
                        description="Write one systemd unit per worker and a target grouping them (--systemd), or "
                        "one YAML file per Kubernetes object (--kubernetes): per stage a headless Service, a "
                        "StatefulSet per host and a PodDisruptionBudget, the bundle's store as a read-only claim, "
                        "the gateway as a Deployment and a Service, and under [tls] secrets.sh making each pod's "
                        "Secret (docs/deploy.md).")
    p.add_argument("file")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--systemd", metavar="DIR", help="folder to write the units into")
    where.add_argument("--kubernetes", metavar="OUT", help="folder to write the Kubernetes objects into")
    p.add_argument("--prefix", help="where the release is extracted on the hosts, or in the images (default /opt/dgr: "
                   "dgr.app.deploy.systemd.DEFAULT_PREFIX); units and pods run <prefix>/bin/dgr-worker")
    p.add_argument("--host", help="--systemd: only this host's workers (default: every host's)")
    p.add_argument("--image", help="--kubernetes: the workers' image (default dgr-worker:<dgr version>)")
    p.add_argument("--tools-image", help="--kubernetes: the image of the bundle check and the gateway, which run "
                   "<prefix>/bin/dgr (default dgr:<dgr version>)")
    p.add_argument("--namespace", help="--kubernetes: the objects' namespace (default: none named, kubectl's own)")
    p.set_defaults(func=_render)
