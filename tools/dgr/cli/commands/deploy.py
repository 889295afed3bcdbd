"""`dgr` subcommands of the deploy area: `dgr deploy plan|render`, `dgr up`, `dgr down`, `dgr status`."""

from __future__ import annotations

import json
import sys


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
    from pathlib import Path

    from dgr.app.deploy.plan import make_plan
    from dgr.app.deploy.spec import DeployError

    if args.kubernetes:
        from dgr.app.deploy import kubernetes

        if args.host:
            raise DeployError("--host goes with --systemd (a Kubernetes render holds every host's workers)")
        plan = make_plan(args.file)
        o = kubernetes.Options.default(args.image, args.tools_image, args.namespace, args.prefix)
        files = kubernetes.render(plan, Path(args.kubernetes), o)
        notes = kubernetes.notes(plan)
    else:
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


def _seconds(text: str) -> float:
    import argparse

    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0")
    return v


def _up(args) -> int:
    import signal

    from dgr.app.deploy.control import Interrupted, StopSignals, down, follow, up, up_run_dir
    from dgr.core.errors import DgrError

    def say(line: str) -> None:
        print(f"dgr up: {line}", file=sys.stderr, flush=True)

    started = False
    with StopSignals() as sigs:     # held through the clean-up below: a second signal does not cut it short
        try:
            r = up(args.file, run_dir=args.run_dir, progress=not args.quiet, ready_timeout=args.ready_timeout,
                   say=say)
            started = True
            if not args.foreground:
                sigs.release()      # from here the run outlives this process, as it is meant to
            print(f"dgr up: {len(r.workers)} worker(s) SERVING after {r.seconds:.1f} s "
                  f"(bundle ready after {r.provision_seconds:.1f} s); supervised, logs in {r.run_dir}/logs")
            for w in r.workers:
                print(f"  {w['name']:<7} stage {w['stage']} [{w['layers'][0]}, {w['layers'][1]})  {w['address']}  "
                      f"log {w['log']}")
            print(f"route: {r.route}")
            print(f"  dgr generate --route \"{r.route}\" \"Hello\"", flush=True)
            if args.foreground:
                say("in the foreground: Ctrl-C or SIGTERM stops the run")
                say(f"{follow(r.run_dir, say)}; nothing of the run is left")
            return 0
        except Interrupted as sig:
            name = signal.Signals(sig.signum).name
            try:
                # `up` stopped what it had started before raising; this finds anything it could not know of
                # (the signal came as it returned) and, after SERVING, stops the run
                res = down(args.file, run_dir=up_run_dir(args.file, args.run_dir))
            except DgrError:
                res = {"stopped": [], "seconds": 0.0}   # it never got as far as a run folder
            if not started:
                say(f"{name} before the workers served: the run is stopped, nothing of it is left")
                return 128 + sig.signum
            say(f"{name}: stopped {len(res['stopped'])} process(es) in {res['seconds']:.1f} s; none left")
            return 0 if args.foreground else 128 + sig.signum


def _down(args) -> int:
    from dgr.app.deploy.control import down

    r = down(args.file, run_dir=args.run_dir)
    print(f"dgr down: stopped {len(r['stopped'])} process(es) in {r['seconds']:.1f} s; none left")
    return 0


def _status(args) -> int:
    from dgr.app.deploy.condition import EXIT
    from dgr.app.deploy.control import status

    s = status(args.file, run_dir=args.run_dir, timeout=args.timeout)
    code = EXIT[s["state"]]
    if args.json:
        print(json.dumps(s, indent=2))
        return code
    if not s["supervised"]:
        print(f"{s['name']}: down: not up (run folder {s['run_dir']}); start it with `dgr up {args.file}`")
        for w in s["workers"]:
            if w["gave_up"]:
                print(f"  {w['name']:<7} stage {w['stage']}  {w['why']} (log {w['log']})")
        if s.get("orphans"):
            print(f"  its supervisor is gone but process(es) {s['orphans']} of the run are left, unsupervised: "
                  f"`dgr down {args.file}` stops them")
        return code
    n_up = sum(w["state"] == "up" for w in s["workers"])
    print(f"{s['name']}: {s['state']} ({n_up} of {len(s['workers'])} local worker(s) up), supervisor pid "
          f"{s['supervisor_pid']}, bundle {(s['bundle_id'] or '')[:12]}")
    for w in s["workers"]:
        load = w["load"] or {}
        ld = (f"; sessions {load.get('open_sessions', 0)}, queued {load.get('queued_steps', 0)}"
              if w["load"] else "")
        if load.get("prefix_cache_off"):
            ld += f"; prefix cache off: {load['prefix_cache_off']}"
        last = f", last exit: {w['last_exit']['how']}" if w["last_exit"] else ""
        why = "" if w["state"] == "up" else f": {w['why']}"
        print(f"  {w['name']:<7} stage {w['stage']}  {w['address']:<21} pid {w['pid'] or '-':<7} "
              f"{w['state']:<8} {w['health']:<11} restarts {w['restarts']}{last}{ld}{why}")
    for w in s["remote"]:
        print(f"  {w['name']:<7} stage {w['stage']}  {w['address']:<21} on host {w['host']} (not this machine, "
              "not probed)")
    for r in s["route_states"]:
        note = "" if r["state"] == "up" else f": {r['why']}"
        print(f"route ({r['state']}{note}): {r['route']}")
    return code


def register(sub) -> None:
    """Add this area's subcommands to the `dgr` parser."""
    from dgr.app.deploy import READY_TIMEOUT_S, STATUS_TIMEOUT_S

    run_help = "the run folder (default: <workspace>/deploy/<name>)"
    found_help = ("the run folder (default: the one the latest `dgr up` of the deployment used, its --run-dir "
                  "or <workspace>/deploy/<name>)")
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

    p = sub.add_parser("up", help="provision, start and supervise the deployment's workers on this machine",
                       description="Provision, start and supervise the deployment's workers on this machine; "
                       "return once every one answers health SERVING. While waiting it reports each worker "
                       "that serves and each exit (with the worker's last log line); it fails at once, "
                       "stopping the run, when a worker is given up on (supervise.give_up_after crashes in a "
                       "row the same way). SIGINT, SIGTERM or SIGHUP before SERVING (or any time with "
                       "--foreground) stops everything it started.")
    p.add_argument("file")
    p.add_argument("--run-dir", help=run_help)
    p.add_argument("--ready-timeout", type=_seconds, metavar="SECONDS",
                   help="how long to wait for every local worker to answer health SERVING before stopping the run "
                   f"and failing (default: the file's supervise.ready_timeout, {READY_TIMEOUT_S:g} s unless it "
                   "sets one)")
    p.add_argument("--foreground", action="store_true",
                   help="stay after SERVING, reporting restarts, until SIGINT/SIGTERM (which stop the run, exit 0) "
                   "or `dgr down`; for a terminal or a service manager")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress (bundle checks, workers SERVING); exits, restarts and give-ups are still told")
    p.set_defaults(func=_up)
    p = sub.add_parser("down", help="stop the deployment's supervisor and workers on this machine")
    p.add_argument("file")
    p.add_argument("--run-dir", help=found_help)
    p.set_defaults(func=_down)
    p = sub.add_parser("status", help="up, degraded or down: the run, each local worker and each route; "
                       "health, load and restarts",
                       description="Whether the run, each local worker and each route is up, degraded or down "
                       "(docs/deploy.md), with each worker's health, load and restarts. Exit status: 0 up, "
                       "4 degraded (every route can serve, not every worker is up), 3 down (not running, or a "
                       "route cannot serve), 2 an error (e.g. the file).")
    p.add_argument("file")
    p.add_argument("--json", action="store_true",
                   help="state (up/degraded/down); per worker: name, stage, address, pid, health, state, why, "
                   "restarts, last_exit, gave_up, load; route_states; routes (those that can serve)")
    p.add_argument("--run-dir", help=found_help)
    p.add_argument("--timeout", type=float, default=STATUS_TIMEOUT_S, metavar="S",
                   help="how long to wait for each worker's health and load answers (default: %(default)g s)")
    p.set_defaults(func=_status)
