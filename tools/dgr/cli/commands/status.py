"""`dgr status`: whether a deployment's run, each local worker and each route is up, degraded or down, with
each worker's health, load and restarts (dgr.app.deploy.control, dgr.app.deploy.condition)."""

from __future__ import annotations

import json

from dgr.app.deploy import STATUS_TIMEOUT_S
from dgr.app.deploy.condition import EXIT
from dgr.cli.shared import FOUND_RUN_DIR_HELP


def _status(args) -> int:
    # lazy: dgr.app.deploy.control costs 157 ms at start-up (python -X importtime, 2026-12-05)
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
    """Add `dgr status` to the `dgr` parser."""
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
    p.add_argument("--run-dir", help=FOUND_RUN_DIR_HELP)
    p.add_argument("--timeout", type=float, default=STATUS_TIMEOUT_S, metavar="S",
                   help="how long to wait for each worker's health and load answers (default: %(default)g s)")
    p.set_defaults(func=_status)
