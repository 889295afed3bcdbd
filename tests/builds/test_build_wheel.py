"""The Python tooling builds as a wheel (`python -m build`) that pip installs, and the installed dgr says
what it carries (`dgr --version`: version, the pin's llama.cpp commit, the patch series) without a checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

from dgr.toolchain.buildinfo import build_info

from support.paths import REPO


def test_wheel_builds_installs_and_reports_the_pin(tmp_path):
    src = tmp_path / "src"
    for rel in ("pyproject.toml", "setup.py", "README.md", "toolchains/llama.cpp.pin.json"):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, src / rel)
    shutil.copytree(REPO / "tools" / "dgr", src / "tools" / "dgr",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "_build.json", "BUILD.bazel"))
    # --no-isolation: build with this environment's setuptools (no download)
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path / "dist"),
                    str(src)], check=True, capture_output=True, timeout=600)
    [wheel] = (tmp_path / "dist").glob("dgr-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    package = sorted(str(p.relative_to(REPO / "tools")) for p in (REPO / "tools" / "dgr").rglob("*.py"))
    assert [n for n in package if n not in names] == [], "modules missing from the wheel"
    assert "dgr/toolchain/_build.json" in names

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(target),
                    str(wheel)], check=True, capture_output=True, timeout=300)
    # the installed copy first, this environment's dependencies after it, no checkout anywhere on the path
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path),
           "PYTHONPATH": f"{target}{os.pathsep}{sysconfig.get_paths()['purelib']}"}
    where = subprocess.run([sys.executable, "-S", "-c", "import dgr; print(dgr.__file__)"], env=env, cwd=tmp_path,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert where.startswith(str(target)), where
    out = subprocess.run([sys.executable, "-S", "-m", "dgr", "--version"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, check=True).stdout
    info = build_info()
    assert out.splitlines()[0].startswith(f"dgr {info.version} (installed")
    assert f"llama.cpp {info.commit}" in out
    assert f"patch series {info.patch_series} ({len(info.patches)} patches" in out
    listed = subprocess.run([sys.executable, "-S", "-m", "dgr", "synth", "--list"], env=env, cwd=tmp_path,
                            capture_output=True, text=True, check=True).stdout.split()
    assert "llama" in listed


def test_version_names_the_pin_and_its_patches(capsys):
    from dgr.cli.main import main
    from dgr.toolchain.pin import load_pin, patch_series

    try:
        main(["--version"])
    except SystemExit as e:
        assert e.code == 0
    out = capsys.readouterr().out
    pin = load_pin()
    assert f"llama.cpp {pin.commit}" in out and patch_series(pin) in out
    assert all(Path(p.file).name.split("-", 1)[0] in out for p in pin.patches)
