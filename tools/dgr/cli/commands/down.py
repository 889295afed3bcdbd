"""`dgr down`: stop a deployment's supervisor and workers on this machine (dgr.app.deploy.control)."""

from __future__ import annotations

from dgr.cli.shared import FOUND_RUN_DIR_HELP


def _down(args) -> int:
    # lazy: dgr.app.deploy.control costs 157 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.app.deploy.control import down

    r = down(args.file, run_dir=args.run_dir)
    print(f"dgr down: stopped {len(r['stopped'])} process(es) in {r['seconds']:.1f} s; none left")
    return 0


def register(sub) -> None:
    """Add `dgr down` to the `dgr` parser."""
    p = sub.add_parser("down", help="stop the deployment's supervisor and workers on this machine")
    p.add_argument("file")
    p.add_argument("--run-dir", help=FOUND_RUN_DIR_HELP)
    p.set_defaults(func=_down)
