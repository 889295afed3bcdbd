"""Extract the files of an archive's `strip_prefix` folder (by default the ones the tree hash covers),
refusing members that escape it."""

from __future__ import annotations

import tarfile
from pathlib import Path
from typing import Callable

from dgr.core.errors import UpstreamError
from dgr.toolchain import treehash


def extract(archive: Path, strip_prefix: str, into: Path,
            keep: Callable[[str], bool] = treehash.is_upstream_file) -> int:
    """Extract the files below `strip_prefix` for which `keep(relative path)` holds (default: those the
    llama.cpp tree hash covers) into `into`; returns their number."""
    prefix = strip_prefix.strip("/") + "/"
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
            if not rel or m.isdir() or not keep(rel):
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
    return len(members)
