"""`dgr up`: provision, start and supervise a deployment's workers on this machine (dgr.app.deploy.control),
returning once each answers health SERVING, or staying with --foreground."""

from __future__ import annotations

import argparse
import signal
import sys

from dgr.app.deploy import READY_TIMEOUT_S
from dgr.core.errors import DgrError


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0")
    return v


def _up(args) -> int:
    # lazy: dgr.app.deploy.control costs 157 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.app.deploy.control import Interrupted, StopSignals, down, follow, up, up_run_dir

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


def register(sub) -> None:
    """Add `dgr up` to the `dgr` parser."""
    p = sub.add_parser("up", help="provision, start and supervise the deployment's workers on this machine",
                       description="Provision, start and supervise the deployment's workers on this machine; "
                       "return once every one answers health SERVING. While waiting it reports each worker "
                       "that serves and each exit (with the worker's last log line); it fails at once, "
                       "stopping the run, when a worker is given up on (supervise.give_up_after crashes in a "
                       "row the same way). SIGINT, SIGTERM or SIGHUP before SERVING (or any time with "
                       "--foreground) stops everything it started.")
    p.add_argument("file")
    p.add_argument("--run-dir", help="the run folder (default: <workspace>/deploy/<name>)")
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
