"""The patched tree: a git repository of the pristine tree plus one commit per pinned patch, made idempotently."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from dgr.core.errors import UpstreamError
from dgr.core.locks import locked
from dgr.core.log import get_logger
from dgr.toolchain.pin import PATCH_DIR_REL, Pin, load_pin
from dgr.toolchain.upstream.fetchtree import staged_dir
from dgr.toolchain.upstream.layout import Layout, layout
from dgr.toolchain.upstream.patchlist import check_patch_list
from dgr.toolchain.upstream.pristine import fetch, verify

log = get_logger(__name__)

GIT_ENV = {
    # Fixed identities and dates: the patched tree's commits are the same on every machine.
    "GIT_AUTHOR_NAME": "dgr", "GIT_AUTHOR_EMAIL": "dgr@localhost",
    "GIT_COMMITTER_NAME": "dgr", "GIT_COMMITTER_EMAIL": "dgr@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z",
    "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull,
}


def git(cwd: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    if shutil.which("git") is None:
        raise UpstreamError("git is not installed; install it (Debian: apt-get install git)")
    env = {**os.environ, **GIT_ENV}
    proc = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise UpstreamError(f"git {' '.join(args)} in {cwd} failed: {proc.stderr.strip()}")
    return proc


def patch_stamp(pin: Pin) -> dict[str, Any]:
    """What the patched tree was made from; a tree whose stamp equals this one is current."""
    return {"commit": pin.commit, "tree_hash": pin.tree_hash,
            "patches": [{"file": p.file, "blake3": p.blake3} for p in pin.patches]}


def local_changes(tree: Path) -> list[str]:
    """Files changed in the patched tree since it was made (git status), and commits made in it."""
    if not (tree / ".git").exists():
        return []
    out = git(tree, "status", "--porcelain", "--untracked-files=normal").stdout.splitlines()
    changes = [line[3:] for line in out]
    made = tree / ".git" / "dgr-head"
    if made.exists():
        head = git(tree, "rev-parse", "HEAD").stdout.strip()
        if head != made.read_text().strip():
            changes.append(f"HEAD moved from {made.read_text().strip()[:12]} (commits not exported as patches?)")
    return changes


def _regen_hint(pin: Pin, patch: str) -> str:
    return (f"regenerate it against llama.cpp {pin.commit[:12]}: in the workspace's upstream/llama.cpp "
            f"(a git repository whose first commit is the pristine pin), redo the change, then "
            f"`git format-patch --zero-commit --no-signature -o {PATCH_DIR_REL} <base>..HEAD` and "
            f"`dgr upstream pin-patches` (docs/upstream.md, 'Regenerating a patch')")


def init_pristine_repo(pristine: Path, dest: Path, message: str, tag: str) -> None:
    """`dest` (empty or new) becomes a git repository whose one commit, tagged `tag`, is `pristine`."""
    shutil.copytree(pristine, dest, dirs_exist_ok=True, symlinks=True)
    git(dest, "init", "-q")
    git(dest, "config", "core.autocrlf", "false")
    git(dest, "add", "-A")
    git(dest, "commit", "-q", "--no-verify", "-m", message)
    git(dest, "tag", tag)


def apply_patches(pin: Pin, pristine: Path, dest: Path) -> None:
    """Make `dest` a git repository holding pristine + each pinned patch as one commit."""
    with staged_dir(dest, ".llama.cpp-") as tmp:
        init_pristine_repo(pristine, tmp, f"llama.cpp {pin.commit} (pristine, dgr pin)", "dgr-pristine")
        for p in pin.patches:
            path = pin.root / p.file
            check = git(tmp, "apply", "--check", "--whitespace=nowarn", str(path), check=False)
            if check.returncode != 0:
                detail = check.stderr.strip().splitlines()
                raise UpstreamError(
                    f"{p.file} does not apply to llama.cpp {pin.commit[:12]} "
                    f"({'; '.join(detail[:3])}); {_regen_hint(pin, p.file)}"
                )
            if path.read_text(errors="replace").startswith("From "):
                am = git(tmp, "am", "-q", "--keep-cr", "--whitespace=nowarn", str(path), check=False)
                if am.returncode != 0:
                    raise UpstreamError(f"{p.file}: git am failed ({am.stderr.strip()}); {_regen_hint(pin, p.file)}")
            else:  # a plain diff: apply it and commit under the file's name
                git(tmp, "apply", "--index", "--whitespace=nowarn", str(path))
                git(tmp, "commit", "-q", "--no-verify", "-m", Path(p.file).name)
        _carry_mtimes(tmp, dest)
        git(tmp, "update-index", "-q", "--refresh", check=False)
        (tmp / ".git" / "dgr-head").write_text(git(tmp, "rev-parse", "HEAD").stdout)


def _carry_mtimes(new: Path, old: Path) -> None:
    """Give each file of the new tree a timestamp that makes incremental builds right.

    A file identical to the one in the tree it replaces keeps that file's timestamp (nothing to
    rebuild); any other file, including one that a removed patch turns back to pristine content,
    is stamped now, so Ninja rebuilds what depends on it instead of trusting an older object.
    """
    now = time.time()
    for dirpath, dirnames, filenames in os.walk(new):
        if ".git" in dirnames and Path(dirpath) == new:
            dirnames.remove(".git")
        for name in filenames:
            path = Path(dirpath) / name
            prev = old / path.relative_to(new)
            if path.is_symlink():
                continue
            try:
                same = prev.stat().st_size == path.stat().st_size and prev.read_bytes() == path.read_bytes()
            except OSError:
                same = False
            mtime = prev.stat().st_mtime if same else now
            os.utime(path, (mtime, mtime))


def patch(pin: Pin | None = None, ws: Path | None = None, *, force: bool = False) -> Path:
    """Make upstream/llama.cpp = pristine + pinned patches (idempotent). Returns its path."""
    pin = pin or load_pin()
    lay = layout(pin, ws)
    check_patch_list(pin)
    with locked(lay.upstream / ".patch.lock"):
        return _patch_locked(pin, lay, ws, force)


def _patch_locked(pin: Pin, lay: Layout, ws: Path | None, force: bool) -> Path:
    stamp = patch_stamp(pin)
    if lay.patched.is_dir() and lay.patched_stamp.exists():
        if json.loads(lay.patched_stamp.read_text()) == stamp:
            return lay.patched
        changed = local_changes(lay.patched)
        if changed and not force:
            raise UpstreamError(
                f"{lay.patched} has local changes ({', '.join(changed[:5])}) and the pinned patches changed; "
                "save your work as a patch first (docs/upstream.md), or pass --force to discard it"
            )
    pristine = fetch(pin, ws)
    verify(pin, ws)
    log.info("applying %d patch(es) to llama.cpp %s", len(pin.patches), pin.commit[:12])
    lay.patched_stamp.unlink(missing_ok=True)
    apply_patches(pin, pristine, lay.patched)
    lay.patched_stamp.write_text(json.dumps(stamp, indent=2) + "\n")
    return lay.patched


def ensure_patched(pin: Pin | None = None, ws: Path | None = None) -> Path:
    """The verified, patched llama.cpp source (fetch/verify/patch whatever is missing; fast when done)."""
    pin = pin or load_pin()
    lay = layout(pin, ws)
    check_patch_list(pin)
    if lay.patched.is_dir() and lay.patched_stamp.exists() and lay.pristine_meta.exists():
        if json.loads(lay.patched_stamp.read_text()) == patch_stamp(pin):
            return lay.patched
    return patch(pin, ws)
