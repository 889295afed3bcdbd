"""The Python dependencies a release carries: locked wheels (name, version, file, sha256), fetched offline-checkable.

A release must start on a bare host that has only `python3`, so it carries the worker's Python
dependencies as wheels unpacked into its `python/` folder (toolchains/bazel/release.py). Which
distributions: the closure of `[tool.dgr.release] python-deps` in pyproject.toml, at the versions installed
in the environment that ran the tests (so a release runs what was tested). `dgr release python-deps --lock`
writes that set to toolchains/python-runtime.lock.json (file names and sha256); `dgr release python-deps`
downloads exactly those files into the workspace's `wheels/` folder, each checked against its sha256,
where Bazel's `@dgr_python_deps` (toolchains/python_deps.bzl) takes them from, checked again.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

from dgr.core.errors import ReleaseError
from dgr.core.log import get_logger
from dgr.core.paths import REPO_ROOT, workspace

LOCK_PATH = REPO_ROOT / "toolchains" / "python-runtime.lock.json"
log = get_logger(__name__)


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def top_level() -> list[str]:
    """`[tool.dgr.release] python-deps` of pyproject.toml: what the worker and the client import."""
    data = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    return list(data["tool"]["dgr"]["release"]["python-deps"])


def closure(names: list[str]) -> dict[str, str]:
    """name -> installed version, for `names` and everything they require on this platform."""
    seen: dict[str, str] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        key = _norm(name)
        if key in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise ReleaseError(f"{name} is not installed in this environment ({sys.prefix}); "
                               "run scripts/setup, then lock again") from None
        seen[key] = dist.version
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return dict(sorted(seen.items()))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _pip_download(args: list[str], dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q", "--no-deps",
           "--only-binary=:all:", "-d", str(dest), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ReleaseError(f"pip download failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")


def write_lock(path: Path = LOCK_PATH) -> dict:
    """Resolve the closure at the installed versions, download each wheel once, record name/file/sha256."""
    pins = closure(top_level())
    with tempfile.TemporaryDirectory(prefix="dgr-wheels-") as tmp:
        _pip_download([f"{n}=={v}" for n, v in pins.items()], Path(tmp))
        wheels = sorted(Path(tmp).glob("*.whl"))
        by_name = {_norm(w.name.split("-")[0]): w for w in wheels}
        missing = sorted(set(pins) - set(by_name))
        if missing:
            raise ReleaseError(f"pip gave no wheel for {', '.join(missing)}")
        entries = [{"name": n, "version": pins[n], "file": by_name[n].name, "sha256": _sha256(by_name[n])}
                   for n in pins]
        dest = wheel_dir()
        dest.mkdir(parents=True, exist_ok=True)
        for w in wheels:
            if not (dest / w.name).exists():
                w.replace(dest / w.name)
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    lock = {"format": 1, "python": tag, "top_level": top_level(), "wheels": entries}
    path.write_text(json.dumps(lock, indent=2) + "\n")
    return lock


def read_lock(path: Path = LOCK_PATH) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ReleaseError(f"{path}: no lock of the release's Python dependencies; "
                           "`dgr release python-deps --lock` writes it") from None


def wheel_dir() -> Path:
    return workspace() / "wheels"


def fetch_locked(path: Path = LOCK_PATH) -> list[Path]:
    """Every locked wheel in the workspace's wheels/ folder, downloaded when absent, checked by sha256."""
    lock = read_lock(path)
    dest = wheel_dir()
    dest.mkdir(parents=True, exist_ok=True)
    need = [e for e in lock["wheels"] if not (dest / e["file"]).is_file() or _sha256(dest / e["file"]) != e["sha256"]]
    if need:
        log.info("downloading %d locked wheel(s) into %s", len(need), dest)
        with tempfile.TemporaryDirectory(prefix="dgr-wheels-") as tmp:
            req = Path(tmp) / "requirements.txt"
            req.write_text("".join(f"{e['name']}=={e['version']} --hash=sha256:{e['sha256']}\n" for e in need))
            _pip_download(["--require-hashes", "-r", str(req)], Path(tmp) / "out")
            for e in need:
                got = Path(tmp) / "out" / e["file"]
                if not got.is_file():
                    raise ReleaseError(f"pip downloaded no {e['file']} (is this machine's platform the lock's, "
                                       f"{lock['python']} manylinux x86_64?)")
                got.replace(dest / e["file"])
    out = []
    for e in lock["wheels"]:
        p = dest / e["file"]
        if _sha256(p) != e["sha256"]:
            raise ReleaseError(f"{p}: sha256 differs from the lock ({LOCK_PATH.name}); delete it and run again")
        out.append(p)
    return out
