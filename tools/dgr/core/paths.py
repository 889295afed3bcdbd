"""Where things live: the repository root and the ignored workspace."""

import os
from pathlib import Path

from dgr.core.constants import WORKSPACE_DIRNAME, WORKSPACE_ENV

# tools/dgr/core/paths.py -> repository root (when running from a checkout or an editable install).
REPO_ROOT = Path(__file__).resolve().parents[3]


def env_path(value: str) -> Path:
    """A path from an environment variable: as given, or under Bazel a runfiles path (tests get
    $DGR_WORKER_BIN and $DGR_FAKE_ENGINE_LIB that way) when that is where the file is."""
    path = Path(value)
    if not path.is_absolute() and not path.exists():
        roots = [os.environ.get(k) for k in ("RUNFILES_DIR", "TEST_SRCDIR")]
        found = [Path(r) / os.environ.get("TEST_WORKSPACE", "") / value for r in roots if r]
        path = next((f for f in found if f.exists()), path)
    return path


def workspace() -> Path:
    """The ignored workspace (upstream source, builds, download cache)."""
    env = os.environ.get(WORKSPACE_ENV)
    root = Path(env) if env else REPO_ROOT / WORKSPACE_DIRNAME
    root.mkdir(parents=True, exist_ok=True)
    return root


ENGINE_LIBRARY = "libdgr_engine.so"


def engine_build_dir(lane: str = "cpu") -> Path:
    """Where `dgr build-engine --lane LANE` builds (the toolchain writes it, the runtime only reads it)."""
    return workspace() / "build" / lane


def default_engine_library(lane: str = "cpu") -> Path:
    """The engine library `dgr build-engine --lane LANE` makes; the runtime loads it when it exists and
    $DGR_ENGINE_LIB is unset, and never builds it."""
    return engine_build_dir(lane) / ENGINE_LIBRARY
