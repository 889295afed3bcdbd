"""Resumable HTTP(S) downloads with retries, once for all of dgr (model sources, upstream archives).

A download streams into `DEST.part`; an interrupted one is continued with an HTTP Range request on the
next call, and transient failures (connection resets, 429/5xx) are retried with backoff by urllib3's
`Retry`. The caller checks the hash of the finished file.
"""

from __future__ import annotations

import os
from pathlib import Path

import requests
from requests.adapters import HTTPAdapter
from tqdm import tqdm
from urllib3.util.retry import Retry

from dgr.core.errors import DgrError, SourceError
from dgr.core.log import get_logger

log = get_logger(__name__)

READ_SIZE = 4 * 1024 * 1024
RETRIES = 5


def _session():
    retry = Retry(total=RETRIES, connect=RETRIES, read=RETRIES, backoff_factor=0.5,
                  status_forcelist=(429, 500, 502, 503, 504), allowed_methods=("GET",),
                  raise_on_status=False)
    s = requests.Session()
    s.mount("http://", HTTPAdapter(max_retries=retry))
    s.mount("https://", HTTPAdapter(max_retries=retry))
    return s


def part_path(dest: Path) -> Path:
    return dest.with_name(dest.name + ".part")


def download(url: str, dest: str | Path, *, progress: bool = True, timeout: float = 60.0,
             error: type[DgrError] = SourceError, what: str | None = None) -> Path:
    """Stream `url` to `dest` (resuming `dest.part`); raises `error` naming `what` (default: the URL)."""
    dest = Path(dest)
    what = what or url
    part = part_path(dest)
    have = part.stat().st_size if part.exists() else 0
    headers = {"Range": f"bytes={have}-"} if have else {}
    if have:
        log.info("fetching %s (resuming at %d bytes)", url, have)
    try:
        with _session() as s, s.get(url, stream=True, headers=headers, timeout=timeout) as r:
            if r.status_code == 416 and have:  # the part file already holds everything
                os.replace(part, dest)
                return dest
            if r.status_code not in (200, 206):
                raise error(f"{what}: HTTP {r.status_code} from {url}; check the URL")
            if r.status_code == 200 and have:
                have = 0  # the server ignored Range: start again
            total = r.headers.get("Content-Length")
            total_n = int(total) + have if total else None
            with open(part, "ab" if have else "wb") as f, tqdm(
                total=total_n, initial=have, unit="B", unit_scale=True, desc=dest.name, disable=not progress
            ) as bar:
                for piece in r.iter_content(READ_SIZE):
                    f.write(piece)
                    bar.update(len(piece))
    except requests.RequestException as e:
        raise error(f"{what}: download failed ({e}); run again to resume from {part}") from e
    os.replace(part, dest)
    return dest
