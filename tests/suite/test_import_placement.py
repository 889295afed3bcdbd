"""The dgr package keeps its imports at the top of each module (docs/TEAM.md, "Imports"), checked by
scripts/lint-imports-placement: an import inside a function says why (an import cycle, a measured start-up
cost, or a package a release does not carry) and no module imports another's private names. The check
passes on the tree and fails, naming the line, on a copy with each kind of fault; and the reason the CLI
keeps some imports in its handlers holds: building `dgr`'s parser (every command module) imports only the
standard library and what a release carries."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support.paths import REPO

SCRIPT = REPO / "scripts" / "lint-imports-placement"
STAMP = "(python -X importtime, 2026-12-05)"


def lint(root: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--root", str(root)], capture_output=True, text=True,
                          timeout=120)


def test_the_tree_keeps_its_imports_at_the_top_or_says_why():
    run = lint()
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip().endswith("0 finding(s)")


@pytest.fixture
def copy(tmp_path):
    """A copy of the package (and the release's lock) to break."""
    shutil.copytree(REPO / "tools" / "dgr", tmp_path / "tools" / "dgr",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "toolchains").mkdir()
    shutil.copy(REPO / "toolchains" / "python-runtime.lock.json", tmp_path / "toolchains")
    return tmp_path


@pytest.mark.parametrize("where, code, said", [
    ("core/paths.py", "def f():\n    from dgr.core.errors import DgrError\n    return DgrError\n",
     "`from dgr.core.errors import DgrError` inside a function"),
    ("core/paths.py", "def f():\n    import json\n    return json\n", "`import json` inside a function"),
    ("core/paths.py", "from dgr.core.hashing import _private\n",
     "imports another module's private name(s) _private"),
    ("core/paths.py", f"def f():\n    # lazy: numpy costs 30 ms at start-up {STAMP}\n    import numpy\n",
     "numpy costs 30 ms: under 50 ms an import goes at the top"),
    ("cli/commands/demo.py", f"def f():\n    # lazy: dgr.app.demo costs 4 ms at start-up {STAMP}\n"
     "    from dgr.app.demo import run_demo\n", "dgr.app.demo costs 4 ms: under 5 ms"),
    ("cli/commands/demo.py", "def f():\n    # lazy: dgr.app.demo needs numpy, not in a release "
     "(pyproject.toml [tool.dgr.release])\n    from dgr.app.demo import run_demo\n", "a release carries numpy"),
    ("cli/commands/demo.py", "def f():\n    # lazy: it is slow\n    from dgr.app.demo import run_demo\n",
     "is none of the forms of a lazy import"),
    ("cli/commands/demo.py", f"def f():\n    # lazy: dgr.app.nothing costs 90 ms at start-up {STAMP}\n"
     "    from dgr.app.demo import run_demo\n", "names dgr.app.nothing, which is no module here"),
])
def test_each_kind_of_fault_fails_naming_the_line(copy, where, code, said):
    path = copy / "tools" / "dgr" / where
    n = len(path.read_text().splitlines())
    path.write_text(path.read_text() + "\n\n" + code)
    run = lint(copy)
    assert run.returncode == 1, run.stdout + run.stderr
    lines = [line for line in run.stdout.splitlines() if said in line]
    assert lines, run.stdout
    line = int(lines[0].split(":")[1])
    assert lines[0].startswith(f"tools/dgr/{where}:") and n < line <= n + 2 + code.count("\n"), lines[0]


def test_a_comment_above_a_run_of_imports_covers_the_run_and_no_more(copy):
    path = copy / "tools" / "dgr" / "cli" / "commands" / "demo.py"
    path.write_text(path.read_text() + f"\n\ndef f():\n    # lazy: dgr.app.demo costs 90 ms at start-up {STAMP}\n"
                    "    from dgr.app.demo import run_demo\n    from dgr.app.local import LocalRoute\n\n"
                    "    from dgr.app.stages import checked_bundle\n")
    run = lint(copy)
    assert run.returncode == 1
    assert [line.split(": ", 1)[1] for line in run.stdout.splitlines()[:-1]] == [
        "`from dgr.app.stages import checked_bundle` inside a function: move it to the top, or say why on the "
        "line before (# lazy: ..., scripts/lint-imports-placement)"]


BARE = r"""
import json, sys
from importlib import metadata

norm = lambda s: s.lower().replace("_", "-").replace(".", "-")
lock = json.load(open(sys.argv[1]))
carried = {w["name"] for w in lock["wheels"]}
blocked = {top for top, dists in metadata.packages_distributions().items()
           if not any(norm(d) in carried for d in dists)} - {"dgr"}


class NotInARelease:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ImportError(f"{name} is not in a release")


sys.meta_path.insert(0, NotInARelease())
from dgr.cli.main import build_parser

build_parser()
print("built")
"""


def test_every_command_module_imports_only_what_a_release_carries():
    """A release's bin/dgr runs on a bare python3 with only its locked wheels (docs/build.md): `dgr --help`
    and `dgr --version` build the parser of every command, so no command module may import at its top a
    package the release does not carry (cryptography, fastapi, matplotlib, ...: those wait in the handler)."""
    run = subprocess.run([sys.executable, "-c", BARE, str(REPO / "toolchains" / "python-runtime.lock.json")],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO / "tools")})
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.strip() == "built"
