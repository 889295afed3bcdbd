"""`dgr inspect`: a GGUF model's layers, widths, seam and bytes (dgr.toolchain.modelreport)."""

from __future__ import annotations

import json


def _inspect(args) -> int:
    # lazy: dgr.toolchain.modelreport costs 58 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.toolchain.modelreport import format_report, inspect_model

    r = inspect_model(args.file)
    print(json.dumps(r, indent=2, sort_keys=True) if args.json else format_report(r))
    return 0


def register(sub) -> None:
    """Add `dgr inspect` to the `dgr` parser."""
    p = sub.add_parser("inspect", help="show a GGUF model's layers, widths, seam and bytes")
    p.add_argument("file")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_inspect)
