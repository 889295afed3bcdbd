"""The import rules of `.importlinter` hold on the tree (one rule per boundary, over folders: cli > app >
toolchain > runtime > gguf > core; the test doubles; the wire without an engine; the gateway as a client;
the benchmarks below certification),
no two modules import each other (directly, through others, or inside functions), and each rule is real:
the same check fails on a copy of the package with one deliberately wrong import."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support.paths import REPO

# Strongly connected components of the import graph (grimp, import-linter's own graph: it reads every
# import statement, those inside functions too), printed as JSON: [[module, ...], ...] of size > 1.
CIRCLES = r"""
import json, sys, grimp
sys.setrecursionlimit(100000)
g = grimp.build_graph("dgr")
index, low, stack, on, out, n = {}, {}, [], set(), [], [0]
def visit(v):
    index[v] = low[v] = n[0]; n[0] += 1; stack.append(v); on.add(v)
    for w in g.find_modules_directly_imported_by(v):
        if w not in index:
            visit(w); low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        comp = []
        while True:
            w = stack.pop(); on.discard(w); comp.append(w)
            if w == v:
                break
        if len(comp) > 1:
            out.append(sorted(comp))
for m in sorted(g.modules):
    if m not in index:
        visit(m)
print(json.dumps(out))
"""


def _run(root: Path, code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root / "tools")}
    return subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """import-linter over the `dgr` package found under root/tools, with root/.importlinter."""
    return _run(root, "import sys; from importlinter.cli import lint_imports; "
                      "sys.exit(lint_imports(config_filename='.importlinter', no_cache=True, no_logo=True))")


def circles(root: Path) -> list[list[str]]:
    proc = _run(root, CIRCLES)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_the_tree_keeps_its_layers():
    proc = lint_imports(REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "broken" not in proc.stdout.lower().replace("0 broken", "")


def test_no_two_modules_import_each_other():
    assert circles(REPO) == []


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tree")
    shutil.copytree(REPO / "tools" / "dgr", root / "tools" / "dgr",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(REPO / ".importlinter", root / ".importlinter")
    assert lint_imports(root).returncode == 0  # the copy itself is clean
    return root


def _with_import(tree: Path, tmp_path: Path, module: str, line: str) -> Path:
    """A copy of `tree` where `module` (a path under tools/dgr) also runs `line`."""
    root = tmp_path / "wrong"
    shutil.copytree(tree, root)
    path = root / "tools" / "dgr" / module
    text = path.read_text()
    # after the module docstring and `from __future__` (an import that really executes)
    head, sep, rest = text.partition("from __future__ import annotations\n")
    path.write_text(head + sep + line + "\n" + rest if sep else line + "\n" + text)
    return root


@pytest.mark.parametrize("module, line, rule, shown", [
    ("core/paths.py", "import dgr.runtime.engine", "Layers", "dgr.core.paths -> dgr.runtime.engine"),
    ("runtime/engine.py", "import dgr.toolchain.enginebuild", "Layers",
     "dgr.runtime.engine -> dgr.toolchain.enginebuild"),
    ("toolchain/recipe.py", "import dgr.app.demo", "Layers", "dgr.toolchain.recipe -> dgr.app.demo"),
    ("toolchain/parity.py", "import dgr.testing.fake_engine", "Only the app and the CLI may start the fake engine",
     "dgr.toolchain.parity -> dgr.testing.fake_engine"),
    ("runtime/wire/client.py", "import dgr.runtime.engine", "The wire (client, codec, TLS) only speaks the wire",
     "dgr.runtime.wire.client -> dgr.runtime.engine"),
    ("app/gateway/route.py", "import dgr.app.demo", "The gateway is only a client of a route",
     "dgr.app.gateway.route -> dgr.app.demo"),
    ("app/bench/speculate_mtp.py", "import dgr.app.certify.fixtures", "Benchmarks measure, certification judges",
     "dgr.app.bench.speculate_mtp -> dgr.app.certify.fixtures"),
], ids=["core-above", "runtime-toolchain", "toolchain-app", "test-doubles", "wire-engine", "gateway-app",
        "bench-certify"])
def test_each_rule_can_fail(tree, tmp_path, module, line, rule, shown):
    proc = lint_imports(_with_import(tree, tmp_path, module, line + "  # deliberately wrong"))
    assert proc.returncode != 0
    out = " ".join(proc.stdout.split())
    assert shown in out, proc.stdout
    verdict = out[out.index(rule):]                     # the rule's own line: "<name> ... KEPT|BROKEN"
    assert verdict.find("BROKEN") != -1 and (verdict.find("KEPT") == -1 or verdict.find("BROKEN") < verdict.find("KEPT")), \
        proc.stdout


def test_a_circle_inside_a_function_is_found(tree, tmp_path):
    root = _with_import(tree, tmp_path, "toolchain/pin.py",
                        "def _back():\n    from dgr.toolchain import buildinfo  # deliberately circular\n")
    assert ["dgr.toolchain.buildinfo", "dgr.toolchain.pin"] in circles(root)


MAX_LINES = 500


def long_files(root: Path) -> list[str]:
    """Python modules under tools/dgr and C++ files under worker/ over MAX_LINES lines (generated stubs aside)."""
    files = [p for p in (root / "tools" / "dgr").rglob("*.py") if "gen" not in p.relative_to(root).parts]
    files += [p for ext in ("*.cpp", "*.h", "*.c") for p in (root / "worker").rglob(ext)]
    return sorted(f"{p.relative_to(root)} ({n} lines)" for p in files
                  if (n := len(p.read_text(errors="replace").splitlines())) > MAX_LINES)


def test_no_file_holds_more_than_one_jobs_worth():
    assert long_files(REPO) == [], f"split these by job (at most {MAX_LINES} lines each)"


def test_the_size_rule_can_fail(tmp_path):
    (tmp_path / "tools" / "dgr").mkdir(parents=True)
    (tmp_path / "worker" / "server").mkdir(parents=True)
    (tmp_path / "tools" / "dgr" / "big.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "worker" / "server" / "big.cpp").write_text("//\n" * (MAX_LINES + 1))
    (tmp_path / "worker" / "server" / "small.h").write_text("//\n" * MAX_LINES)
    assert long_files(tmp_path) == [f"tools/dgr/big.py ({MAX_LINES + 1} lines)",
                                    f"worker/server/big.cpp ({MAX_LINES + 1} lines)"]
