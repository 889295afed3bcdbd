"""The import contracts of `.importlinter` (the runtime never imports the build toolchain, the layers
cli > commands > app > wire > engine, the client never imports the worker) hold on the tree, and they
are real: the same check fails on a copy of the package with one deliberately wrong import."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """import-linter over the `dgr` package found under root/tools, with root/.importlinter."""
    code = ("import sys; from importlinter.cli import lint_imports; "
            "sys.exit(lint_imports(config_filename='.importlinter', no_cache=True, no_logo=True))")
    env = {**os.environ, "PYTHONPATH": str(root / "tools")}
    return subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_tree_keeps_its_layers():
    proc = lint_imports(REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "broken" not in proc.stdout.lower().replace("0 broken", "")


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / "tree"
    shutil.copytree(REPO / "tools" / "dgr", root / "tools" / "dgr",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(REPO / ".importlinter", root / ".importlinter")
    return root


def _add_import(module: Path, line: str) -> None:
    text = module.read_text()
    # after the module docstring and `from __future__` (an import that really executes)
    head, sep, rest = text.partition("from __future__ import annotations\n")
    module.write_text(head + sep + line + "\n" + rest if sep else line + "\n" + text)


def test_a_runtime_module_importing_the_toolchain_is_refused(tmp_path):
    root = _copy(tmp_path)
    assert lint_imports(root).returncode == 0  # the copy itself is clean
    _add_import(root / "tools" / "dgr" / "engine.py", "import dgr.enginebuild  # deliberately wrong")
    proc = lint_imports(root)
    assert proc.returncode != 0
    assert "dgr.engine -> dgr.enginebuild" in proc.stdout, proc.stdout


def test_the_client_running_an_engine_is_refused(tmp_path):
    root = _copy(tmp_path)
    _add_import(root / "tools" / "dgr" / "wire" / "client.py", "import dgr.engine  # deliberately wrong")
    proc = lint_imports(root)
    assert proc.returncode != 0
    assert "dgr.wire.client -> dgr.engine" in proc.stdout, proc.stdout
