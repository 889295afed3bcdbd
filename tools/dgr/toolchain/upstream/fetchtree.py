"""One pinned source tree into the workspace: the first source that works, its archive sha256-checked,
the wanted files extracted and checked in a temporary folder, then moved into place.

Used for llama.cpp (`dgr.toolchain.upstream.pristine`: the tree hash is the check) and for the vendored C sources
dgr-worker compiles in (`dgr.toolchain.upstream.vendored`: BLAKE3).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from dgr.core.errors import UpstreamError
from dgr.core.log import get_logger
from dgr.toolchain.pin import Archive, PypiSdist
from dgr.toolchain.upstream.extract import extract
from dgr.toolchain.upstream.sources import fetch_archive

log = get_logger(__name__)


@dataclass(frozen=True)
class Fetched:
    source: PypiSdist | Archive  # the source that worked
    archive: Path  # its verified archive in the download cache
    files: int  # how many files were extracted
    seconds: float
    checked: Any  # what `check` returned


def fetch_tree(sources: Sequence[PypiSdist | Archive], download_name: str, downloads: Path, dest: Path, *,
               keep: Callable[[str], bool], check: Callable[[Path], Any], what: str, pin_path: Path) -> Fetched:
    """`dest` filled from the first of `sources` that works.

    Each source's archive lands in `downloads/<src.download_name(download_name)>` (sha256 checked against
    the pin, `fetch_archive`); the files of its `strip_prefix` that `keep` selects are extracted into a
    temporary folder beside `dest`, `check(folder)` runs on them (it raises UpstreamError to refuse the
    source) and the folder replaces `dest`. The caller holds the fetch lock. Raises UpstreamError naming
    every source's failure when none works.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    failures = []
    for src in sources:
        t0 = time.monotonic()
        try:
            archive = fetch_archive(src, downloads / src.download_name(download_name))
        except UpstreamError as err:
            failures.append(str(err))
            log.warning("source failed: %s", err)
            continue
        tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name[:24]}-"))
        try:
            try:
                n = extract(archive, src.strip_prefix, tmp, keep)
                checked = check(tmp)
            except UpstreamError as err:
                failures.append(f"{src.describe()}: {err}")
                log.warning("source failed: %s", failures[-1])
                continue
            if dest.exists():
                shutil.rmtree(dest)
            os.replace(tmp, dest)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
        return Fetched(src, archive, n, round(time.monotonic() - t0, 1), checked)
    raise UpstreamError(f"could not fetch {what} from any source in {pin_path}:\n  " + "\n  ".join(failures))


@contextmanager
def staged_dir(dest: Path, prefix: str) -> Iterator[Path]:
    """A fresh temporary folder beside `dest` to fill; when the block ends without an exception it replaces
    `dest` whole (os.replace: never half a tree), and it is removed in any case."""
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=prefix))
    try:
        yield tmp
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
