"""Where the pinned upstream lives in the workspace: one path per state (download, pristine, patched).

Under `dgr.core.paths.workspace()` (ignored by git):

    cache/downloads/<file>              archives, kept only once their sha256 matched the pin
    upstream/src-<commit>/              pristine tree: only the files the tree hash covers, verified
    upstream/src-<commit>.json          which source it came from, its archive sha256, tree hash
    upstream/src-<commit>.listing       the verified canonical listing (names a changed file later)
    upstream/llama.cpp/                 pristine + patches/llama.cpp/*.patch in the pin's order;
                                        a git repository (base commit + one commit per patch)
    upstream/llama.cpp.stamp.json       commit, tree hash and the patch hashes that were applied
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dgr.core.paths import workspace
from dgr.toolchain.pin import Pin


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
    """The paths of `pin`'s upstream in workspace `ws` (default: `dgr.core.paths.workspace()`)."""
    return Layout(Path(ws) if ws else workspace(), pin.commit)
