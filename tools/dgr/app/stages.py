"""A bundle's stage as the worker front end checks it before `dgr-worker` takes over (docs/worker.md)."""

from __future__ import annotations

from pathlib import Path

from dgr.core.errors import WireError
from dgr.core.locks import locked
from dgr.core.paths import workspace
from dgr.toolchain.buildinfo import build_info
from dgr.toolchain.bundle import load_bundle, verify_bundle


def patch_series() -> tuple[str, str]:
    """(upstream commit, hash over the ordered patch stack): the release's metadata, or the checkout's pin."""
    info = build_info()
    return info.commit, info.patch_series


def checked_bundle(path: str | Path, stage: int, *, verify: bool = True):
    """The bundle at `path`, once `stage` is one of its stages and (`verify`) its files match the
    manifest's hashes; WireError saying which otherwise."""
    b = load_bundle(path)
    n = len(b.manifest.stages)
    if not 0 <= stage < n:
        raise WireError(f"bundle {b.root} has {n} stages (0..{n - 1}); there is no stage {stage}")
    if verify:
        # Workers of one bundle usually start together; verify one at a time (the later ones find the
        # chunks already checked in the resumable verify state).
        with locked(workspace() / "state" / "locks" / f"verify-{b.id[:16]}.lock"):
            verify_bundle(b.root)
    return b


