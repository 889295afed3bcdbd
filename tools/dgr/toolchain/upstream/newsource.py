"""The source a pin bump moves to (`dgr upstream bump SOURCE`): fetched, verified, its tree hashed.

SOURCE is a `llama-cpp-python==VERSION` sdist or a local llama.cpp folder. What is verified:

  sdist   its sha256 (against `--sha256` when given, against the pin when the pin already names this
          version); the llama.cpp commit it vendors, read three ways that must agree (the gitlink of
          `vendor/llama.cpp` in the sdist's own `.git`, the submodule's HEAD, the CHANGELOG's "update
          llama.cpp to ggml-org/llama.cpp@<prefix>" line of that version); and every file the tree hash
          covers against that commit's own git tree (blob ids and modes), which the sdist carries in
          `.git/modules/vendor/llama.cpp`: the vendored files are exactly the commit's.
  folder  a git work tree: its HEAD is the commit and every covered file must equal HEAD's (no local
          edits); a plain folder: `--commit` names the commit and nothing can check it (said so).

The covered files are copied into the scratch workspace's `upstream/src-<commit>/` with the metadata
`dgr.toolchain.upstream.pristine` writes, so the existing fetch/patch code finds the tree verified and fetches nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from dgr.core.download import download
from dgr.core.errors import UpstreamError
from dgr.core.hashing import file_sha256
from dgr.core.log import get_logger
from dgr.toolchain import treehash
from dgr.toolchain.pin import Pin, PypiSdist
from dgr.toolchain.upstream.apply import GIT_ENV
from dgr.toolchain.upstream.extract import extract
from dgr.toolchain.upstream.fetchtree import staged_dir
from dgr.toolchain.upstream.layout import layout
from dgr.toolchain.upstream.sources import fetch_archive, sdist_url

log = get_logger(__name__)

VENDOR_DIR = "vendor/llama.cpp"  # where llama-cpp-python vendors llama.cpp (a git submodule)
GITHUB_ARCHIVE = "https://github.com/ggml-org/llama.cpp/archive/{commit}.tar.gz"
UNKNOWN_SHA256 = "0" * 64  # a scratch pin's stand-in for an archive nobody hashed; never written to the repo
_COMMIT = re.compile(r"[0-9a-f]{40}")
_SPEC = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][A-Za-z0-9.+!-]*)")


@dataclass
class NewSource:
    """A verified llama.cpp tree to bump to, and what the new pin would say about it."""

    label: str  # scratch folder name: the sdist's version, or tree-<commit12>
    describe: str  # for people: "pypi-sdist llama-cpp-python==0.3.35", "folder /path"
    commit: str
    date: str | None  # the commit's date (YYYY-MM-DD) when known
    subject: str | None  # the commit's subject line when known
    tree: Path  # the verified pristine copy in the scratch workspace
    tree_hash: str
    files: int
    sources: list[dict] = field(default_factory=list)  # the new pin's `sources` (none yet for a folder)
    checks: list[str] = field(default_factory=list)  # what was verified, one sentence each
    unpinnable: str | None = None  # why no pin may be written from this source (None: it may)
    archive: Path | None = None  # the verified sdist, for the main workspace's download cache


def parse_source(text: str) -> tuple[str, str] | Path:
    """(package, version) for `NAME==VERSION`, a Path for an existing folder; UpstreamError otherwise."""
    m = _SPEC.fullmatch(text.strip())
    if m:
        return m.group(1), m.group(2)
    path = Path(text).expanduser()
    if path.is_dir():
        return path.resolve()
    raise UpstreamError(f"SOURCE {text!r}: give a llama-cpp-python sdist as `llama-cpp-python==VERSION`, or an "
                        "existing llama.cpp source folder")


def source_label(text: str, commit: str | None = None) -> str:
    """The scratch folder's name for SOURCE, known before anything is fetched: the sdist's version, or
    tree-<commit12> for a folder (its git HEAD, else --commit)."""
    spec = parse_source(text)
    if not isinstance(spec, Path):
        return spec[1]
    head = git(spec, "rev-parse", "HEAD", check=False) if (spec / ".git").exists() else None
    c = head.stdout.strip() if head is not None and head.returncode == 0 else commit
    if not c or not _COMMIT.fullmatch(c):
        raise UpstreamError(f"{spec} is not a git work tree: name its llama.cpp commit with --commit "
                            "(40 lowercase hex)")
    return f"tree-{c[:12]}"


def resolve(text: str, pin: Pin, scratch_ws: Path, *, sha256: str | None = None, commit: str | None = None,
            archive_sha256: str | None = None, ws: Path | None = None) -> NewSource:
    """Fetch and verify SOURCE; its covered files end up in `scratch_ws`'s pristine tree. `ws` is the main
    workspace, whose download cache may already hold the sdist."""
    spec = parse_source(text)
    if isinstance(spec, Path):
        new = _from_folder(spec, commit, scratch_ws)
    else:
        if commit:
            raise UpstreamError("--commit is for a plain folder; an sdist names its own commit")
        new = _from_sdist(*spec, pin, scratch_ws, sha256, ws)
    if archive_sha256:
        if not re.fullmatch(r"[0-9a-f]{64}", archive_sha256):
            raise UpstreamError(f"--archive-sha256 {archive_sha256!r}: give 64 lowercase hex characters")
        new.sources.append({**placeholder_source(new.commit), "sha256": archive_sha256})
        new.unpinnable = None
    return new


def git(cwd: Path, *args: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
    """git with dgr's fixed environment (dgr.toolchain.upstream.apply.GIT_ENV), optionally fed `input`."""
    if shutil.which("git") is None:
        raise UpstreamError("git is not installed; install it (Debian: apt-get install git)")
    proc = subprocess.run(["git", *args], cwd=cwd, env={**os.environ, **GIT_ENV}, capture_output=True, text=True,
                          input=input)
    if check and proc.returncode != 0:
        raise UpstreamError(f"git {' '.join(args)} in {cwd} failed: {proc.stderr.strip()}")
    return proc


def placeholder_source(commit: str) -> dict:
    """The scratch pin's source for a folder nobody has an archive hash of (never written to the repository)."""
    return {"kind": "archive", "url": GITHUB_ARCHIVE.format(commit=commit), "sha256": UNKNOWN_SHA256,
            "strip_prefix": f"llama.cpp-{commit}", "verified_here": False}


# --- an sdist ---------------------------------------------------------------------------------------------


def _from_sdist(package: str, version: str, pin: Pin, scratch_ws: Path, sha256: str | None,
                ws: Path | None) -> NewSource:
    downloads = scratch_ws / "cache" / "downloads"
    known = next((s for s in pin.sources if isinstance(s, PypiSdist) and s.package == package
                  and s.version == version), None)
    checks = []
    if known is not None:
        if sha256 and sha256 != known.sha256:
            raise UpstreamError(f"--sha256 {sha256} disagrees with {pin.path.name}, which pins {known.describe()} "
                                f"at {known.sha256}")
        archive = _fetch_known(known, layout(pin, ws).downloads, downloads)
        got = known.sha256
        checks.append(f"{archive.name}: sha256 {known.sha256} (as {pin.path.name} pins it)")
    else:
        archive = _pip_download(package, version, downloads)
        got = file_sha256(archive)
        if sha256 and got != sha256:
            archive.unlink()
            raise UpstreamError(f"{archive.name}: sha256 {got}, but --sha256 says {sha256}; the file was refused")
        checks.append(f"{archive.name}: sha256 {got}" + (" (as --sha256 says)" if sha256 else
                                                          " (first seen here: pass --sha256 to require a known hash)"))
    top = _top_folder(archive)
    meta = scratch_ws.parent / "sdist"
    if meta.exists():
        shutil.rmtree(meta)
    meta.mkdir(parents=True)
    try:
        extract(archive, top, meta, _git_records)
    except UpstreamError:  # no .git and no changelog: the commit cannot be read from the sdist
        pass
    _neutral_config(meta / ".git", meta / ".git" / "modules" / "vendor" / "llama.cpp")
    commit, how = _vendored_commit(meta, version)
    checks.append(f"llama.cpp commit {commit}: {how}")
    strip = f"{top}/{VENDOR_DIR}"
    tree = _stage_tree(scratch_ws, commit, lambda tmp: extract(archive, strip, tmp))
    gitdir = meta / ".git" / "modules" / "vendor" / "llama.cpp"
    date, subject = _commit_facts(gitdir, commit)
    checks.append(_check_against_commit(tree, gitdir, commit))
    src = {"kind": "pypi-sdist", "package": package, "version": version, "filename": archive.name,
           "sha256": got, "strip_prefix": strip}
    new = NewSource(label=version, describe=f"pypi-sdist {package}=={version}", commit=commit, date=date,
                    subject=subject, tree=tree, tree_hash="", files=0, sources=[src], checks=checks,
                    archive=archive)
    return _hashed(new, scratch_ws)


def _git_records(rel: str) -> bool:
    """What the commit is read and checked from: the changelog and the git object stores and refs. Never the
    sdist's git config or hooks (a config can name programs for git to run); `_neutral_config` writes one."""
    if rel == "CHANGELOG.md":
        return True
    if not rel.startswith(".git/"):
        return False
    name = rel.rsplit("/", 1)[-1]
    parts = rel.split("/")
    return not ({"hooks", "info", "logs"} & set(parts)) and name not in ("config", "config.worktree", "index")


def _neutral_config(*gitdirs: Path) -> None:
    for d in gitdirs:
        if d.is_dir():
            (d / "config").write_text("[core]\n\trepositoryformatversion = 0\n\tbare = true\n")


def _fetch_known(src: PypiSdist, cache: Path, downloads: Path) -> Path:
    """The pin's own sdist: from the main workspace's download cache `cache` when it is there (sha256 checked)."""
    dest = downloads / src.filename
    cached = cache / src.filename
    if not dest.exists() and cached.is_file():
        downloads.mkdir(parents=True, exist_ok=True)
        try:
            os.link(cached, dest)
        except OSError:
            shutil.copy2(cached, dest)
    return fetch_archive(src, dest)


def _pip_download(package: str, version: str, downloads: Path) -> Path:
    """`pip download` of an sdist whose sha256 nobody has pinned yet (pip verifies what the index says about
    it); the same command as dgr.toolchain.upstream.sources, which needs the sha256 beforehand."""
    downloads.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=downloads, prefix=".pip-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", package,
               "--progress-bar", "off", "-vv", f"{package}=={version}", "-d", tmp]
        log.info("fetching %s==%s with pip download", package, version)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = sorted(Path(tmp).glob("*.tar.gz"))
        if len(got) == 1:
            dest = downloads / got[0].name
            os.replace(got[0], dest)
            return dest
        name = f"{package.replace('-', '_')}-{version}.tar.gz"
        url = sdist_url(proc.stdout + proc.stderr, name)
        if url is None:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            raise UpstreamError(f"pip download {package}=={version} gave no sdist (exit {proc.returncode}): "
                                f"{' | '.join(tail)}; check the version exists (`pip index versions {package}`)")
        dest = downloads / name
        download(url, dest, progress=sys.stderr.isatty(), timeout=30.0, error=UpstreamError,
                 what=f"{package}=={version}")
        return dest


def _top_folder(archive: Path) -> str:
    try:
        with tarfile.open(archive) as tar:
            first = tar.next()
    except tarfile.TarError as err:
        raise UpstreamError(f"{archive}: not a readable tar archive ({err})") from None
    if first is None:
        raise UpstreamError(f"{archive}: an empty archive")
    return first.name.split("/", 1)[0]


def _vendored_commit(meta: Path, version: str) -> tuple[str, str]:
    """The commit the sdist vendors and how it was established; UpstreamError when its records disagree."""
    found: dict[str, str] = {}
    sup = meta / ".git"
    if sup.is_dir():
        proc = git(meta, "--git-dir", str(sup), "ls-tree", "HEAD", VENDOR_DIR, check=False)
        parts = proc.stdout.split()
        if proc.returncode == 0 and len(parts) >= 3 and parts[1] == "commit":
            found["the sdist's gitlink of vendor/llama.cpp"] = parts[2]
    head = sup / "modules" / "vendor" / "llama.cpp" / "HEAD"
    if head.is_file() and _COMMIT.fullmatch(head.read_text().strip()):
        found["the submodule's HEAD"] = head.read_text().strip()
    if not found:
        raise UpstreamError("the sdist records no llama.cpp commit (no .git with a vendor/llama.cpp gitlink): "
                            "bump from a llama.cpp folder with --commit, or from a release whose sdist has them")
    commits = set(found.values())
    if len(commits) > 1:
        raise UpstreamError("the sdist's records of its llama.cpp commit disagree: "
                            + "; ".join(f"{k}: {v}" for k, v in found.items()))
    commit = commits.pop()
    how = " and ".join(found)
    prefix = _changelog_commit(meta / "CHANGELOG.md", version)
    if prefix is not None:
        if not commit.startswith(prefix):
            raise UpstreamError(f"the sdist vendors llama.cpp {commit} ({how}), but its CHANGELOG says {version} "
                                f"updates llama.cpp to {prefix}: refused")
        how += f" agree; CHANGELOG {version}: llama.cpp@{prefix}"
    else:
        how += " (the CHANGELOG names no llama.cpp commit for this version)"
    return commit, how


def _changelog_commit(path: Path, version: str) -> str | None:
    """The first `llama.cpp@<hex>` of the `## [version]` section of a Keep-a-Changelog file."""
    if not path.is_file():
        return None
    section = re.search(rf"^## \[{re.escape(version)}\][^\n]*\n(.*?)(?=^## \[|\Z)", path.read_text(errors="replace"),
                        re.M | re.S)
    m = re.search(r"llama\.cpp@([0-9a-f]{7,40})", section.group(1)) if section else None
    return m.group(1) if m else None


def _commit_facts(gitdir: Path, commit: str) -> tuple[str | None, str | None]:
    """(date YYYY-MM-DD, subject) of `commit` in `gitdir`, or (None, None) when it is not there."""
    if not gitdir.is_dir():
        return None, None
    proc = git(gitdir, "--git-dir", str(gitdir), "log", "-1", "--format=%cs%x00%s", commit, check=False)
    if proc.returncode != 0 or "\0" not in proc.stdout:
        return None, None
    date, subject = proc.stdout.strip().split("\0", 1)
    return date, subject


def _check_against_commit(tree: Path, gitdir: Path, commit: str) -> str:
    """Every covered file of `tree` against `commit`'s git tree in `gitdir` (blob id and mode); UpstreamError
    naming the first difference, or a sentence saying what was checked (or that nothing could be)."""
    proc = git(gitdir, "--git-dir", str(gitdir), "ls-tree", "-r", "-z", "--full-tree", commit, check=False) \
        if gitdir.is_dir() else None
    if proc is None or proc.returncode != 0:
        return ("files: NOT checked against the commit (the source carries no git tree of it); the tree hash "
                "below is taken on trust")
    want: dict[str, tuple[str, str]] = {}
    for rec in proc.stdout.split("\0"):
        if not rec:
            continue
        meta, path = rec.split("\t", 1)
        mode, kind, blob = meta.split()
        if kind == "blob" and treehash.is_upstream_file(path):
            want[path] = ("l" if mode == "120000" else "x" if mode == "100755" else "-", blob)
    have = {e.path: e.mode for e in treehash.listing(tree)}
    for path in sorted(set(want) | set(have)):
        if path not in have:
            raise UpstreamError(f"{path}: in llama.cpp {commit[:12]} but missing from the source: refused")
        if path not in want:
            raise UpstreamError(f"{path}: in the source but not in llama.cpp {commit[:12]}: refused")
        if have[path] != want[path][0]:
            raise UpstreamError(f"{path}: mode {have[path]!r} in the source, {want[path][0]!r} in the commit: refused")
    paths = sorted(p for p in want if want[p][0] != "l")
    # absolute paths: inside another repository (the checkout's .dgr/) git resolves relative ones from its top
    got = git(tree, "hash-object", "--no-filters", "--stdin-paths", check=False,
              input="".join(f"{tree / p}\n" for p in paths)) if paths else None
    blobs = got.stdout.split() if got is not None and got.returncode == 0 else []
    if len(blobs) != len(paths):
        raise UpstreamError(f"git hash-object failed on {tree}: {got.stderr.strip() if got else ''}")
    for path, blob in zip(paths, blobs):
        if blob != want[path][1]:
            raise UpstreamError(f"{path}: differs from llama.cpp {commit[:12]}'s (blob {blob[:12]}, the commit has "
                                f"{want[path][1][:12]}): the source was altered; refused")
    for path in (p for p in want if want[p][0] == "l"):
        target = os.readlink(tree / path)
        link = git(tree, "hash-object", "--no-filters", "--stdin", check=False, input=target)
        if link.stdout.strip() != want[path][1]:
            raise UpstreamError(f"{path}: symlink target differs from llama.cpp {commit[:12]}'s: refused")
    return f"files: all {len(want)} covered files equal llama.cpp {commit[:12]}'s own git tree (blob ids and modes)"


# --- a folder ----------------------------------------------------------------------------------------------


def _from_folder(folder: Path, commit: str | None, scratch_ws: Path) -> NewSource:
    top = git(folder, "rev-parse", "--show-toplevel", check=False)
    is_repo = top.returncode == 0 and Path(top.stdout.strip()).resolve() == folder
    checks = []
    date = subject = None
    if is_repo:
        head = git(folder, "rev-parse", "HEAD").stdout.strip()
        if commit and commit != head:
            raise UpstreamError(f"--commit {commit} is not {folder}'s HEAD ({head}); check out the commit first")
        commit = head
        dirty = [line[3:] for line in git(folder, "status", "--porcelain", "--untracked-files=all").stdout.splitlines()
                 if treehash.is_upstream_file(line[3:].split(" -> ")[-1].strip('"'))]
        if dirty:
            raise UpstreamError(f"{folder}: build files differ from HEAD {commit[:12]} ({', '.join(dirty[:5])}); "
                                "commit or stash them: a pin names a commit, not a work tree")
        date, subject = _commit_facts(_gitdir(folder), commit)
        checks.append(f"llama.cpp commit {commit}: the folder's git HEAD, no local edits to build files")
    else:
        if not commit or not _COMMIT.fullmatch(commit):
            raise UpstreamError(f"{folder} is not a git work tree: name its llama.cpp commit with --commit "
                                "(40 lowercase hex)")
        checks.append(f"llama.cpp commit {commit}: as --commit says (a plain folder: not checked)")
    tree = _stage_tree(scratch_ws, commit, lambda tmp: _copy_covered(folder, tmp))
    if is_repo:
        checks.append(_check_against_commit(tree, _gitdir(folder), commit))
    new = NewSource(label=f"tree-{commit[:12]}", describe=f"folder {folder}", commit=commit, date=date,
                    subject=subject, tree=tree, tree_hash="", files=0, sources=[], checks=checks,
                    unpinnable=("a folder is not a source anyone else can fetch: pass --archive-sha256 (the sha256 of "
                                f"{GITHUB_ARCHIVE.format(commit=commit)}) to pin that archive, or bump from an sdist"))
    return _hashed(new, scratch_ws)


def _gitdir(folder: Path) -> Path:
    return Path(git(folder, "rev-parse", "--absolute-git-dir").stdout.strip())


def _copy_covered(folder: Path, into: Path) -> int:
    n = 0
    for e in treehash.listing(folder):
        dst = into / e.path
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(folder / e.path, dst, follow_symlinks=False)
        n += 1
    return n


# --- the scratch workspace's pristine tree ----------------------------------------------------------------------


def _stage_tree(scratch_ws: Path, commit: str, fill) -> Path:
    """upstream/src-<commit>/ of the scratch workspace, filled afresh by `fill(tmp)`."""
    up = scratch_ws / "upstream"
    up.mkdir(parents=True, exist_ok=True)
    dest = up / f"src-{commit}"
    with staged_dir(dest, ".src-") as tmp:
        fill(tmp)
    return dest


def _hashed(new: NewSource, scratch_ws: Path) -> NewSource:
    """The tree hash, and the metadata that makes dgr.toolchain.upstream.pristine take the tree as fetched."""
    entries = treehash.listing(new.tree)
    new.tree_hash, new.files = treehash.hash_listing(entries), len(entries)
    up = scratch_ws / "upstream"
    (up / f"src-{new.commit}.listing").write_text(treehash.listing_text(entries))
    (up / f"src-{new.commit}.json").write_text(json.dumps({
        "commit": new.commit, "source": new.describe, "archive": new.archive.name if new.archive else None,
        "sha256": new.sources[0]["sha256"] if new.sources else None, "tree_hash": new.tree_hash,
        "files": new.files, "fetch_seconds": 0}, indent=2) + "\n")
    new.checks.append(f"tree hash {new.tree_hash} over {new.files} files (rules v{treehash.RULES_VERSION})")
    return new


def listing_text(new: NewSource) -> str:
    return (new.tree.parent / f"src-{new.commit}.listing").read_text()
