"""Entry point of Bazel's Python targets: finds the lane's engine through runfiles, then runs dgr.

    dgr_launcher.py --engine <rootpath of libdgr_engine_<lane>.so> [--pytest TEST.py ... -OPTION ...] [DGR ARGS...]

(pytest options one argument each, the value joined: `-mnot slow`, `--durations=10`.)

The engine is located with the `runfiles` library (PyPI `bazel-runfiles`; rules_python's under
current Bazel) and handed to dgr as $DGR_ENGINE_LIB, the variable dgr.runtime.engine reads, so that tests and
the worker use the Bazel-built engine of their lane and never build one themselves.

A test module that collects no tests fails (pytest's exit 5 stays an error): a tests/*/test_*.py of
helpers only, or one whose tests all vanished, must not pass as green. Only when the caller's own
options (-m, -k) deselected every collected test does the run pass, since it ran what was asked.
tests/suite/test_suite_launcher.py runs this file outside Bazel with a runfiles folder it makes itself.
"""

from __future__ import annotations

import os
import sys

# The main repository's name in runfiles: WORKSPACE names it `dgr`; bzlmod calls it `_main`.
_MAIN_REPOS = ("dgr", "_main")


def _runfiles():
    try:  # PyPI bazel-runfiles (offline Bazel 4 path)
        from runfiles import runfiles
    except ImportError:  # rules_python (MODULE.bazel path)
        from python.runfiles import runfiles  # type: ignore[no-redef]
    return runfiles.Create()


def locate(rootpath: str) -> str:
    """The real path of a main-repository runfile given as $(rootpath ...)."""
    r = _runfiles()
    tried = []
    for repo in _MAIN_REPOS:
        path = r.Rlocation(f"{repo}/{rootpath}") if r else None
        if path and os.path.exists(path):
            return os.path.realpath(path)
        tried.append(f"{repo}/{rootpath}")
    raise SystemExit(f"dgr_launcher: {rootpath} is not in this target's runfiles (tried {', '.join(tried)})")


class _Deselections:
    """A pytest plugin that counts tests the options deselected (to tell them from an empty module)."""

    def __init__(self) -> None:
        self.count = 0

    def pytest_deselected(self, items) -> None:
        self.count += len(items)


def run_pytest(tests: list[str], opts: list[str]) -> int:
    """pytest over real test files; exit 5 (no tests collected) is a failure unless `opts` deselected them."""
    import pytest

    seen = _Deselections()
    code = pytest.main(["-p", "no:cacheprovider", *opts, *tests], plugins=[seen])
    if code == pytest.ExitCode.NO_TESTS_COLLECTED:
        if seen.count:
            print(f"dgr_launcher: all {seen.count} tests of {' '.join(tests)} deselected by {' '.join(opts)}: "
                  "nothing asked for ran, nothing failed", file=sys.stderr)
            return 0
        print(f"dgr_launcher: FAILED: {' '.join(tests)} collected no tests. A tests/*/test_*.py must hold tests; "
              "helpers belong in tests/support/.", file=sys.stderr)
    return int(code)


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "--engine":
        os.environ["DGR_ENGINE_LIB"] = locate(argv[1])
        argv = argv[2:]
    if argv and argv[0] == "--pytest":
        # The real test file (not its runfiles link): pytest's rootdir, pyproject.toml (markers) and
        # conftest.py are then the repository's, as in a plain `pytest` run, and tests/ is on sys.path
        # (tests/support/ importable) as it is there.
        tests = [locate(t) for t in argv[1:] if not t.startswith("-")]
        opts = [t for t in argv[1:] if t.startswith("-")]
        return run_pytest(tests, opts)
    from dgr.cli.main import main as dgr_main

    return dgr_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
