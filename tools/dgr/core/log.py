"""Logging for dgr: one logger tree (`dgr.*`), progress and notices on stderr, set up once by the CLI.

Library code calls `log = get_logger(__name__)` and `log.info(...)`; nothing prints to stderr by hand.
"""

from __future__ import annotations

import logging
import sys

ROOT = "dgr"


def get_logger(name: str) -> logging.Logger:
    """The logger of a dgr module (`__name__`), under the `dgr` root."""
    return logging.getLogger(name if name == ROOT or name.startswith(ROOT + ".") else f"{ROOT}.{name}")


def setup(level: int = logging.INFO) -> None:
    """Messages as `dgr: ...` lines on stderr (the CLI and worker processes call this once)."""
    root = logging.getLogger(ROOT)
    if any(getattr(h, "_dgr", False) for h in root.handlers):
        root.setLevel(level)
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("dgr: %(message)s"))
    handler._dgr = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False
