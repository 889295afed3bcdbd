"""Vendored C sources dgr-worker compiles in, pinned like llama.cpp: the official BLAKE3 C implementation.

`worker/third_party/blake3.json` is the pin (its sources, the archive's sha256, the blake3 of each file
used). `fetch_vendored()` fetches it the way the llama.cpp tree is fetched (`dgr.toolchain.upstream.fetchtree`: the
first source that works, sha256-checked, the pinned files extracted and each checked) into

    cache/downloads/<name>-<version>.tar.gz     the archive, kept only once its sha256 matched
    upstream/<name>-<version>/                  the pinned files, each checked against the pin
    upstream/<name>-<version>.json              which source, the archive's sha256, the files

`dgr build-engine` passes the folder to CMake (-DDGR_BLAKE3_SRC); Bazel's `@blake3` (toolchains/blake3.bzl)
reads the same pin and the same cached archive.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError, field_validator

from dgr.core.contract import STRICT
from dgr.core.errors import UpstreamError
from dgr.core.hashing import file_blake3
from dgr.core.locks import locked
from dgr.core.log import get_logger
from dgr.core.paths import REPO_ROOT, workspace
from dgr.toolchain.pin import Source
from dgr.toolchain.upstream.fetchtree import fetch_tree

log = get_logger(__name__)

BLAKE3_PIN = REPO_ROOT / "worker" / "third_party" / "blake3.json"
_HEX64 = re.compile(r"[0-9a-f]{64}")


class VendoredPin(BaseModel):
    """A pinned C source: where to get it and the blake3 of each file used from it."""

    model_config = STRICT
    comment: str | None = Field(None, alias="_comment")
    name: str
    version: str  # the archive's (the sdist's) version: the cache key
    c_version: str | None = None
    license: str | None = None
    sources: tuple[Source, ...]  # tried in order
    files: dict[str, str]  # path under the source's strip_prefix -> blake3

    @field_validator("files")
    @classmethod
    def _files(cls, v: dict[str, str]) -> dict[str, str]:
        for name, digest in v.items():
            if name.startswith("/") or ".." in name.split("/") or not _HEX64.fullmatch(digest):
                raise ValueError(f"{name!r}: give a relative path and the 64-hex blake3 of the file")
        if not v:
            raise ValueError("is empty; name the files used")
        return v

    @property
    def key(self) -> str:
        return f"{self.name}-{self.version}"


def load_vendored_pin(path: Path | str = BLAKE3_PIN) -> VendoredPin:
    path = Path(path)
    try:
        return VendoredPin.model_validate_json(path.read_text())
    except OSError as err:
        raise UpstreamError(f"{path}: cannot read the pin ({err.strerror})") from None
    except ValidationError as err:
        raise UpstreamError(f"{path}: not a valid pin: {err}") from None


def _bad_file(pin: VendoredPin, tree: Path) -> str | None:
    """The first pinned file missing from `tree` or differing from the pin, described; None when all match."""
    for name, expected in sorted(pin.files.items()):
        p = tree / name
        if not p.is_file():
            return f"{name} is missing"
        got = file_blake3(p)
        if got != expected:
            return f"{name} has blake3 {got}, the pin says {expected}"
    return None


def fetch_vendored(pin: VendoredPin | None = None, ws: Path | None = None, pin_path: Path = BLAKE3_PIN) -> Path:
    """The pinned files, fetched and checked (no download when already there and unchanged)."""
    pin = pin or load_vendored_pin(pin_path)
    ws = Path(ws) if ws else workspace()
    dest = ws / "upstream" / pin.key
    meta = ws / "upstream" / f"{pin.key}.json"

    def fetched() -> bool:
        if not (dest.is_dir() and meta.is_file()):
            return False
        try:
            m = json.loads(meta.read_text())
        except (OSError, ValueError):
            return False
        return m.get("files") == pin.files and _bad_file(pin, dest) is None

    if fetched():
        return dest
    with locked(ws / "upstream" / f".{pin.key}.fetch.lock"):
        if fetched():
            return dest
        meta.unlink(missing_ok=True)

        def check(tree: Path) -> None:
            if (why := _bad_file(pin, tree)) is not None:
                raise UpstreamError(f"{why}: refused (a wrong or tampered source, or a pin that needs updating)")

        done = fetch_tree(pin.sources, pin.key, ws / "cache" / "downloads", dest, keep=lambda rel: rel in pin.files,
                          check=check, what=f"{pin.name} {pin.version}", pin_path=pin_path)
        meta.write_text(json.dumps({"name": pin.name, "version": pin.version, "source": done.source.describe(),
                                    "archive": done.archive.name, "sha256": done.source.sha256,
                                    "files": pin.files, "fetch_seconds": done.seconds}, indent=2) + "\n")
        log.info("%s %s from %s: %d files verified", pin.name, pin.version, done.source.describe(), done.files)
        return dest
