"""Entry point of Bazel's Python targets: finds the lane's engine through runfiles, then runs dgr.

    dgr_launcher.py --engine <rootpath of libdgr_engine_<lane>.so> [--pytest TEST.py ...] [DGR ARGS...]

The engine is located with the `runfiles` library (PyPI `bazel-runfiles`; rules_python's under
current Bazel) and handed to dgr as $DGR_ENGINE_LIB, the variable dgr.engine reads, so that tests and
the worker use the Bazel-built engine of their lane and never build one themselves.
"""

from __future__ import annotations

import os
import sys

try:  # PyPI bazel-runfiles (offline Bazel 4 path)
    from runfiles import runfiles
except ImportError:  # rules_python (MODULE.bazel path)
    from python.runfiles import runfiles  # type: ignore[no-redef]

# The main repository's name in runfiles: WORKSPACE names it `dgr`; bzlmod calls it `_main`.
_MAIN_REPOS = ("dgr", "_main")


def locate(rootpath: str) -> str:
    """The real path of a main-repository runfile given as $(rootpath ...)."""
    r = runfiles.Create()
    tried = []
    for repo in _MAIN_REPOS:
        path = r.Rlocation(f"{repo}/{rootpath}") if r else None
        if path and os.path.exists(path):
            return os.path.realpath(path)
        tried.append(f"{repo}/{rootpath}")
    raise SystemExit(f"dgr_launcher: {rootpath} is not in this target's runfiles (tried {', '.join(tried)})")


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "--engine":
        os.environ["DGR_ENGINE_LIB"] = locate(argv[1])
        argv = argv[2:]
    if argv and argv[0] == "--pytest":
        import pytest

        tests = [locate(t) for t in argv[1:] if not t.startswith("-")]
        opts = [t for t in argv[1:] if t.startswith("-")]
        # The real test file (not its runfiles link): pytest's rootdir, pyproject.toml (markers) and
        # conftest.py are then the repository's, as in a plain `pytest` run.
        code = pytest.main(["-p", "no:cacheprovider", *opts, *tests])
        if code == pytest.ExitCode.NO_TESTS_COLLECTED:
            # A tests/test_*.py of helpers only (e.g. test_engine_support.py): nothing to fail.
            print(f"dgr_launcher: no tests in {' '.join(argv[1:])}: passed", file=sys.stderr)
            return 0
        return int(code)
    from dgr.cli import main as dgr_main

    return dgr_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
