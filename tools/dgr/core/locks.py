"""Cross-process locks on workspace state (one fetch, patch, build or verify at a time), with `filelock`."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from filelock import FileLock, Timeout

from dgr.core.log import get_logger

log = get_logger(__name__)


@contextlib.contextmanager
def locked(lockfile: str | Path) -> Iterator[None]:
    """Hold `lockfile` exclusively; says so once when another dgr process holds it and we wait."""
    lockfile = Path(lockfile)
    lockfile.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(lockfile))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("waiting for another dgr process (%s)", lockfile)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()
