"""The pinned llama.cpp: fetch, verify against the pin, patch. See docs/upstream.md.

Workspace layout (under `dgr.paths.workspace()`, ignored by git):

    cache/downloads/<file>              archives, kept only once their sha256 matched the pin
    upstream/src-<commit>/              pristine tree: only the files the tree hash covers, verified
    upstream/src-<commit>.json          which source it came from, its archive sha256, tree hash
    upstream/src-<commit>.listing       the verified canonical listing (names a changed file later)
    upstream/llama.cpp/                 pristine + patches/llama.cpp/*.patch in the pin's order;
                                        a git repository (base commit + one commit per patch)
    upstream/llama.cpp.stamp.json       commit, tree hash and the patch hashes that were applied

The pin (`toolchains/llama.cpp.pin.json`) is the only place the commit, archive hashes and tree
hash are written; Bazel and Nix read the same file.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import blake3

from dgr import treehash
from dgr.constants import LANES
from dgr.errors import UpstreamError
from dgr.paths import REPO_ROOT, workspace

PIN_PATH = REPO_ROOT / "toolchains" / "llama.cpp.pin.json"
PATCH_DIR_REL = "patches/llama.cpp"

_GIT_ENV = {
    # Fixed identities and dates: the patched tree's commits are the same on every machine.
    "GIT_AUTHOR_NAME": "dgr", "GIT_AUTHOR_EMAIL": "dgr@localhost",
    "GIT_COMMITTER_NAME": "dgr", "GIT_COMMITTER_EMAIL": "dgr@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z",
    "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull,
}


def _say(msg: str) -> None:
    print(f"dgr: {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def locked(lockfile: Path) -> Iterator[None]:
    """Serialise work on one workspace folder across processes (two test sessions, a CLI call)."""
    lockfile.parent.mkdir(parents=True, exist_ok=True)
    with open(lockfile, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"waiting for another dgr process ({lockfile})")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# --------------------------------------------------------------------------------------------
# The pin


@dataclass(frozen=True)
class Source:
    kind: str  # "pypi-sdist" | "archive"
    sha256: str
    strip_prefix: str
    filename: str
    package: str = ""
    version: str = ""
    url: str = ""

    def describe(self) -> str:
        if self.kind == "pypi-sdist":
            return f"pypi-sdist {self.package}=={self.version}"
        return f"archive {self.url}"


@dataclass(frozen=True)
class PatchEntry:
    file: str  # relative to the repository root, e.g. patches/llama.cpp/0001-x.patch
    blake3: str


@dataclass(frozen=True)
class Pin:
    path: Path
    commit: str
    release: str
    sources: tuple[Source, ...]
    tree_hash: str | None
    patches: tuple[PatchEntry, ...]
    raw: dict[str, Any] = field(repr=False, compare=False)
    tree_listing: str | None = None  # repository-relative; its blake3 is tree_hash

    def explain_tree(self, entries: list[treehash.Entry], fallback: Path | None = None) -> str:
        """Name the first file of `entries` that differs from the pinned tree, when a listing says."""
        for listing in ([self.root / self.tree_listing] if self.tree_listing else []) + ([fallback] if fallback else []):
            if listing.exists() and self.tree_hash:
                return treehash.explain(listing, self.tree_hash, entries)
        return "(no listing of the pinned tree to name the file)"

    @property
    def root(self) -> Path:
        """The repository the pin belongs to (patch paths are relative to it)."""
        return self.path.resolve().parents[1]

    @property
    def patch_dir(self) -> Path:
        return self.root / PATCH_DIR_REL


def load_pin(path: Path | str | None = None) -> Pin:
    """Read and check the pin file; errors name the file and the field."""
    path = Path(path) if path else PIN_PATH
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise UpstreamError(f"{path}: pin file not found (the repository must hold toolchains/llama.cpp.pin.json)")
    except json.JSONDecodeError as err:
        raise UpstreamError(f"{path}: not valid JSON ({err}); fix the file (see docs/upstream.md)")

    def need(obj: dict, key: str, where: str, kind: type = str) -> Any:
        if not isinstance(obj.get(key), kind):
            raise UpstreamError(f"{path}: field {where}{key} is missing or not a {kind.__name__}")
        return obj[key]

    commit = need(raw, "commit", "")
    if len(commit) != 40 or any(c not in "0123456789abcdef" for c in commit):
        raise UpstreamError(f"{path}: field commit must be a full 40-hex lowercase commit, got {commit!r}")
    sources = []
    for i, s in enumerate(need(raw, "sources", "", list)):
        where = f"sources[{i}]."
        kind = need(s, "kind", where)
        sha = need(s, "sha256", where)
        if len(sha) != 64:
            raise UpstreamError(f"{path}: field {where}sha256 must be 64 hex characters")
        prefix = need(s, "strip_prefix", where)
        if kind == "pypi-sdist":
            sources.append(Source(kind, sha, prefix, need(s, "filename", where),
                                  package=need(s, "package", where), version=need(s, "version", where)))
        elif kind == "archive":
            url = need(s, "url", where)
            sources.append(Source(kind, sha, prefix, f"{commit}{_archive_suffix(url)}", url=url))
        else:
            raise UpstreamError(f"{path}: field {where}kind is {kind!r}; known kinds: pypi-sdist, archive")
    if not sources:
        raise UpstreamError(f"{path}: field sources is empty; name at least one source")
    tree = raw.get("tree_hash")
    if tree is not None and (not isinstance(tree, str) or len(tree) != 64):
        raise UpstreamError(f"{path}: field tree_hash must be 64 hex characters (blake3) or null")
    patches = []
    for i, p in enumerate(need(raw, "patches", "", list)):
        patches.append(PatchEntry(need(p, "file", f"patches[{i}]."), need(p, "blake3", f"patches[{i}].")))
    listing = raw.get("tree_listing")
    if listing is not None and not isinstance(listing, str):
        raise UpstreamError(f"{path}: field tree_listing must be a repository-relative path or absent")
    return Pin(path, commit, raw.get("release", ""), tuple(sources), tree, tuple(patches), raw, listing)


def _archive_suffix(url: str) -> str:
    for suffix in (".tar.gz", ".tgz", ".tar.xz", ".tar.bz2", ".tar"):
        if url.endswith(suffix):
            return suffix
    return ".tar.gz"


def _require_tree_hash(pin: Pin) -> str:
    if not pin.tree_hash:
        raise UpstreamError(
            f"{pin.path}: tree_hash is null; compute it from a trusted copy with "
            "`python3 tools/dgr/treehash.py DIR` and write it into the pin (docs/upstream.md, 'Updating the pin')"
        )
    return pin.tree_hash


# --------------------------------------------------------------------------------------------
# Workspace paths


@dataclass(frozen=True)
class Layout:
    ws: Path
    commit: str

    @property
    def downloads(self) -> Path:
        return self.ws / "cache" / "downloads"

    @property
    def upstream(self) -> Path:
        return self.ws / "upstream"

    @property
    def pristine(self) -> Path:
        return self.upstream / f"src-{self.commit}"

    @property
    def pristine_meta(self) -> Path:
        return self.upstream / f"src-{self.commit}.json"

    @property
    def pristine_listing(self) -> Path:
        return self.upstream / f"src-{self.commit}.listing"

    @property
    def patched(self) -> Path:
        return self.upstream / "llama.cpp"

    @property
    def patched_stamp(self) -> Path:
        return self.upstream / "llama.cpp.stamp.json"


def layout(pin: Pin, ws: Path | None = None) -> Layout:
    return Layout(Path(ws) if ws else workspace(), pin.commit)


# --------------------------------------------------------------------------------------------
# Fetch


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _check_sha256(path: Path, expected: str, what: str) -> None:
    got = sha256_file(path)
    if got != expected:
        raise UpstreamError(
            f"{what}: sha256 mismatch for {path.name}: the pin expects {expected}, got {got}; "
            "the file was refused (a wrong or tampered download, or a pin that needs updating: docs/upstream.md)"
        )


def _download_pypi_sdist(src: Source, dest: Path) -> None:
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".pip-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--progress-bar", "off", "-q",
               f"{src.package}=={src.version}", "-d", tmp]
        _say(f"fetching {src.package}=={src.version} with pip download")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / src.filename
        if not got.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            raise UpstreamError(f"pip download {src.package}=={src.version} gave no {src.filename} "
                                f"(exit {proc.returncode}): {' | '.join(tail)}")
        _check_sha256(got, src.sha256, src.describe())
        os.replace(got, dest)


def _download_archive(src: Source, dest: Path, timeout: float = 30.0) -> None:
    """Download with resume: a `.part` file is continued with an HTTP Range request."""
    import requests

    part = dest.with_name(dest.name + ".part")
    have = part.stat().st_size if part.exists() else 0
    headers = {"Range": f"bytes={have}-"} if have else {}
    _say(f"fetching {src.url}" + (f" (resuming at {have} bytes)" if have else ""))
    try:
        with requests.get(src.url, headers=headers, stream=True, timeout=timeout) as r:
            if r.status_code == 416:  # the part file already holds everything
                pass
            else:
                r.raise_for_status()
                mode = "ab" if (have and r.status_code == 206) else "wb"
                with open(part, mode) as f:
                    for chunk in r.iter_content(1 << 20):
                        f.write(chunk)
    except requests.RequestException as err:
        raise UpstreamError(f"{src.describe()}: download failed ({err}); run again to resume")
    try:
        _check_sha256(part, src.sha256, src.describe())
    except UpstreamError:
        part.unlink(missing_ok=True)  # a bad part file must not be resumed
        raise
    os.replace(part, dest)


def fetch_archive(src: Source, downloads: Path) -> Path:
    """The verified archive of one source in the download cache (downloaded when missing)."""
    downloads.mkdir(parents=True, exist_ok=True)
    dest = downloads / src.filename
    if dest.exists():
        if sha256_file(dest) == src.sha256:
            return dest
        _say(f"{dest}: cached file does not match the pin's sha256; fetching it again")
        dest.unlink()
    if src.kind == "pypi-sdist":
        _download_pypi_sdist(src, dest)
    else:
        _download_archive(src, dest)
    return dest


def _extract(archive: Path, strip_prefix: str, into: Path) -> int:
    """Extract the tree-hash files below strip_prefix into `into`; returns the number of files."""
    prefix = strip_prefix.strip("/") + "/"
    n = 0
    try:
        tar = tarfile.open(archive)
    except tarfile.TarError as err:
        raise UpstreamError(f"{archive}: not a readable tar archive ({err}); delete it and fetch again")
    with tar:
        members = []
        for m in tar:
            if not m.name.startswith(prefix):
                continue
            rel = m.name[len(prefix):]
            if ".." in rel.split("/") or rel.startswith("/"):
                raise UpstreamError(f"{archive.name}: member {m.name} points outside {strip_prefix}; refused")
            if not rel or m.isdir() or not treehash.is_upstream_file(rel):
                continue
            if not (m.isfile() or m.issym()):
                raise UpstreamError(f"{archive.name}: member {m.name} is neither a file nor a symlink; refused")
            m.name = rel
            members.append(m)
        if not members:
            raise UpstreamError(f"{archive.name}: nothing under {strip_prefix!r}; check the pin's strip_prefix")
        try:
            tar.extractall(into, members=members, filter="data")
        except tarfile.FilterError as err:
            raise UpstreamError(f"{archive.name}: unsafe member refused ({err})")
        n = len(members)
    return n


def fetch(pin: Pin | None = None, ws: Path | None = None) -> Path:
    """Fetch and verify the pristine tree (no-op when present). Returns upstream/src-<commit>/."""
    pin = pin or load_pin()
    lay = layout(pin, ws)
    if _fetched(pin, lay):
        return lay.pristine
    with locked(lay.upstream / ".fetch.lock"):
        return _fetch_locked(pin, lay)


def _fetched(pin: Pin, lay: Layout) -> bool:
    """A pristine tree is there, verified against this pin's tree hash when it was fetched."""
    if not (lay.pristine.is_dir() and lay.pristine_meta.exists()):
        return False
    return json.loads(lay.pristine_meta.read_text()).get("tree_hash") == pin.tree_hash


def _fetch_locked(pin: Pin, lay: Layout) -> Path:
    if _fetched(pin, lay):  # another process just made it
        return lay.pristine
    expected = _require_tree_hash(pin)
    lay.upstream.mkdir(parents=True, exist_ok=True)
    lay.pristine_meta.unlink(missing_ok=True)
    failures = []
    for src in pin.sources:
        t0 = time.monotonic()
        try:
            archive = fetch_archive(src, lay.downloads)
        except UpstreamError as err:
            failures.append(str(err))
            _say(f"source failed: {err}")
            continue
        tmp = Path(tempfile.mkdtemp(dir=lay.upstream, prefix=f".src-{pin.commit[:12]}-"))
        try:
            try:
                n = _extract(archive, src.strip_prefix, tmp)
            except UpstreamError as err:
                failures.append(str(err))
                _say(f"source failed: {err}")
                continue
            entries = treehash.listing(tmp)
            got = treehash.hash_listing(entries)
            if got != expected:
                failures.append(f"{src.describe()}: tree hash {got} does not match the pin's {expected}; "
                                + pin.explain_tree(entries))
                _say(f"source failed: {failures[-1]}")
                continue
            if lay.pristine.exists():
                shutil.rmtree(lay.pristine)
            os.replace(tmp, lay.pristine)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
        lay.pristine_listing.write_text(treehash.listing_text(entries))
        meta = {"commit": pin.commit, "source": src.describe(), "archive": archive.name,
                "sha256": src.sha256, "tree_hash": got, "files": n,
                "fetch_seconds": round(time.monotonic() - t0, 1)}
        lay.pristine_meta.write_text(json.dumps(meta, indent=2) + "\n")
        _say(f"llama.cpp {pin.commit[:12]} from {src.describe()}: {n} files, tree hash verified")
        return lay.pristine
    raise UpstreamError(
        f"could not fetch llama.cpp {pin.commit} from any source in {pin.path}:\n  "
        + "\n  ".join(failures)
    )


def verify(pin: Pin | None = None, ws: Path | None = None) -> str:
    """Recompute the pristine tree's hash; raise naming the first differing file. Returns the hash."""
    pin = pin or load_pin()
    lay = layout(pin, ws)
    expected = _require_tree_hash(pin)
    if not lay.pristine.is_dir():
        raise UpstreamError(f"{lay.pristine}: not fetched; run `dgr upstream fetch`")
    entries = treehash.listing(lay.pristine)
    got = treehash.hash_listing(entries)
    if got != expected:
        msg = f"{lay.pristine}: tree hash {got} does not match the pin's {expected}; "
        msg += pin.explain_tree(entries, fallback=lay.pristine_listing)
        raise UpstreamError(msg + "; delete the folder and run `dgr upstream fetch` to restore it")
    return got


# --------------------------------------------------------------------------------------------
# Patches


def patch_files_in_dir(pin: Pin) -> list[str]:
    """The patch files present, as repository-relative paths in apply order: the common stack by name
    (NNNN-topic), then each lane's own patches (patches/llama.cpp/<lane>/NNNN-topic.patch), lanes by name."""
    if not pin.patch_dir.is_dir():
        return []
    files = [f"{PATCH_DIR_REL}/{p.name}" for p in sorted(pin.patch_dir.glob("*.patch"))]
    for lane in sorted(LANES):
        files += [f"{PATCH_DIR_REL}/{lane}/{p.name}" for p in sorted((pin.patch_dir / lane).glob("*.patch"))]
    return files


def patch_lane(file: str) -> str | None:
    """The lane a patch belongs to (its folder under patches/llama.cpp/), or None for the common stack."""
    parts = file.split("/")
    return parts[-2] if len(parts) >= 2 and parts[-2] in LANES else None


def lane_dir(lane: str) -> str:
    """The only upstream folder a lane's own patch may touch: its ggml backend."""
    return f"ggml/src/ggml-{'hip' if lane == 'rocm' else lane}/"


def touched_files(patch: Path) -> list[str]:
    """Upstream paths a git-format patch changes (from its `diff --git a/X b/Y` lines)."""
    out = []
    for line in patch.read_text(errors="replace").splitlines():
        if line.startswith("diff --git a/"):
            a, _, b = line[len("diff --git a/"):].partition(" b/")
            out += [a, b]
    return out


def check_lane_patch(pin: Pin, file: str) -> None:
    """A lane's own patch touches only that lane's backend folder, so that applying it to the one
    shared tree leaves every other lane's sources byte-identical (docs/upstream.md, 'Lane patches')."""
    lane = patch_lane(file)
    if lane is None:
        return
    where = lane_dir(lane)
    outside = [f for f in touched_files(pin.root / file) if not f.startswith(where)]
    if outside:
        raise UpstreamError(
            f"{file}: a {lane}-lane patch may only change {where}, but it changes {', '.join(sorted(set(outside)))}; "
            f"move that change into the common stack ({PATCH_DIR_REL}/NNNN-topic.patch) or out of the patch"
        )


def check_patch_list(pin: Pin) -> None:
    """Fail when patches/llama.cpp/ and the pin's patch list disagree (names, order or bytes)."""
    listed = [p.file for p in pin.patches]
    present = patch_files_in_dir(pin)
    fix = "run `dgr upstream pin-patches` to rewrite the pin's list from the folder"
    for f in present:
        if f not in listed:
            raise UpstreamError(f"{f}: in {PATCH_DIR_REL}/ but not in {pin.path.name}'s patches; {fix}")
    for f in listed:
        if f not in present:
            raise UpstreamError(f"{f}: listed in {pin.path.name} but missing from {PATCH_DIR_REL}/; {fix}")
    if listed != present:
        raise UpstreamError(f"{pin.path.name}: patches are listed out of name order ({listed}); {fix}")
    for p in pin.patches:
        got = treehash.file_digest(pin.root / p.file)
        if got != p.blake3:
            raise UpstreamError(
                f"{p.file}: blake3 {got} does not match the pin's {p.blake3}: the patch changed after it "
                f"was pinned; if the change is intended, {fix}"
            )
        check_lane_patch(pin, p.file)


def pin_patches(pin: Pin | None = None) -> list[dict[str, str]]:
    """Rewrite the pin's `patches` from patches/llama.cpp/*.patch (name order); returns the list."""
    pin = pin or load_pin()
    entries = []
    for f in patch_files_in_dir(pin):
        name = f.rsplit("/", 1)[1]
        if not (len(name) > 5 and name[:4].isdigit() and name[4] == "-"):
            raise UpstreamError(f"{f}: patch names must look like NNNN-topic.patch (applied in name order)")
        check_lane_patch(pin, f)
        entries.append({"file": f, "blake3": treehash.file_digest(pin.root / f)})
    raw = dict(pin.raw)
    raw["patches"] = entries
    tmp = pin.path.with_name(pin.path.name + ".tmp")
    tmp.write_text(json.dumps(raw, indent=2) + "\n")
    os.replace(tmp, pin.path)
    return entries


def _git(cwd: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    if shutil.which("git") is None:
        raise UpstreamError("git is not installed; install it (Debian: apt-get install git)")
    env = {**os.environ, **_GIT_ENV}
    proc = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise UpstreamError(f"git {' '.join(args)} in {cwd} failed: {proc.stderr.strip()}")
    return proc


def _patch_stamp(pin: Pin) -> dict[str, Any]:
    return {"commit": pin.commit, "tree_hash": pin.tree_hash,
            "patches": [{"file": p.file, "blake3": p.blake3} for p in pin.patches]}


def local_changes(tree: Path) -> list[str]:
    """Files changed in the patched tree since it was made (git status), and commits made in it."""
    if not (tree / ".git").exists():
        return []
    out = _git(tree, "status", "--porcelain", "--untracked-files=normal").stdout.splitlines()
    changes = [line[3:] for line in out]
    made = tree / ".git" / "dgr-head"
    if made.exists():
        head = _git(tree, "rev-parse", "HEAD").stdout.strip()
        if head != made.read_text().strip():
            changes.append(f"HEAD moved from {made.read_text().strip()[:12]} (commits not exported as patches?)")
    return changes


def _regen_hint(pin: Pin, patch: str) -> str:
    return (f"regenerate it against llama.cpp {pin.commit[:12]}: in the workspace's upstream/llama.cpp "
            f"(a git repository whose first commit is the pristine pin), redo the change, then "
            f"`git format-patch --zero-commit --no-signature -o {PATCH_DIR_REL} <base>..HEAD` and "
            f"`dgr upstream pin-patches` (docs/upstream.md, 'Regenerating a patch')")


def apply_patches(pin: Pin, pristine: Path, dest: Path) -> None:
    """Make `dest` a git repository holding pristine + each pinned patch as one commit."""
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".llama.cpp-"))
    try:
        shutil.copytree(pristine, tmp, dirs_exist_ok=True, symlinks=True)
        _git(tmp, "init", "-q")
        _git(tmp, "config", "core.autocrlf", "false")
        _git(tmp, "add", "-A")
        _git(tmp, "commit", "-q", "--no-verify", "-m", f"llama.cpp {pin.commit} (pristine, dgr pin)")
        _git(tmp, "tag", "dgr-pristine")
        for p in pin.patches:
            path = pin.root / p.file
            check = _git(tmp, "apply", "--check", "--whitespace=nowarn", str(path), check=False)
            if check.returncode != 0:
                detail = check.stderr.strip().splitlines()
                raise UpstreamError(
                    f"{p.file} does not apply to llama.cpp {pin.commit[:12]} "
                    f"({'; '.join(detail[:3])}); {_regen_hint(pin, p.file)}"
                )
            if path.read_text(errors="replace").startswith("From "):
                am = _git(tmp, "am", "-q", "--keep-cr", "--whitespace=nowarn", str(path), check=False)
                if am.returncode != 0:
                    raise UpstreamError(f"{p.file}: git am failed ({am.stderr.strip()}); {_regen_hint(pin, p.file)}")
            else:  # a plain diff: apply it and commit under the file's name
                _git(tmp, "apply", "--index", "--whitespace=nowarn", str(path))
                _git(tmp, "commit", "-q", "--no-verify", "-m", Path(p.file).name)
        _carry_mtimes(tmp, dest)
        _git(tmp, "update-index", "-q", "--refresh", check=False)
        (tmp / ".git" / "dgr-head").write_text(_git(tmp, "rev-parse", "HEAD").stdout)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


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
    stamp = _patch_stamp(pin)
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
    _say(f"applying {len(pin.patches)} patch(es) to llama.cpp {pin.commit[:12]}")
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
        if json.loads(lay.patched_stamp.read_text()) == _patch_stamp(pin):
            return lay.patched
    return patch(pin, ws)


def status(pin: Pin | None = None, ws: Path | None = None) -> dict[str, Any]:
    """What is fetched, verified and applied (for `dgr upstream status` and the engine build)."""
    pin = pin or load_pin()
    lay = layout(pin, ws)
    out: dict[str, Any] = {"commit": pin.commit, "release": pin.release, "pin": str(pin.path),
                           "tree_hash": pin.tree_hash, "workspace": str(lay.ws)}
    meta = json.loads(lay.pristine_meta.read_text()) if lay.pristine_meta.exists() else None
    out["fetched"] = bool(meta and lay.pristine.is_dir())
    out["source"] = meta["source"] if meta else None
    if out["fetched"]:
        try:
            verify(pin, ws)
            out["verified"], out["verify_error"] = True, None
        except UpstreamError as err:
            out["verified"], out["verify_error"] = False, str(err)
    else:
        out["verified"], out["verify_error"] = False, None
    try:
        check_patch_list(pin)
        out["patch_list_error"] = None
    except UpstreamError as err:
        out["patch_list_error"] = str(err)
    stamp = json.loads(lay.patched_stamp.read_text()) if lay.patched_stamp.exists() else None
    out["patched"] = str(lay.patched) if stamp and lay.patched.is_dir() else None
    out["patches_applied"] = [p["file"] for p in stamp["patches"]] if stamp else []
    out["patches_current"] = bool(stamp) and stamp == _patch_stamp(pin)
    out["local_changes"] = local_changes(lay.patched) if out["patched"] else []
    return out
