"""What this dgr is: its version, the llama.cpp commit it carries and the patch series, from a release or the checkout.

A release (toolchains/bazel/release.py) holds `release.json` and `upstream.json` beside its `python/`
folder: there the runtime reads them and never needs the source tree. An installed wheel carries
`dgr/toolchain/_build.json` (written from the pin by setup.py). In a checkout the same facts come from the one pin
file (toolchains/llama.cpp.pin.json). `dgr --version` prints `describe()`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from dgr import __version__
from dgr.core.hashing import series_hash
from dgr.core.paths import REPO_ROOT
from dgr.toolchain import pin


@dataclass(frozen=True)
class BuildInfo:
    version: str
    source: str                         # "release <lane>" or "checkout"
    commit: str                         # llama.cpp
    patches: tuple[tuple[str, str], ...]  # (file, blake3) in order
    python: str = ""                    # the release's wheels' Python tag (cp311), "" in a checkout

    @property
    def patch_series(self) -> str:
        return series_hash(list(self.patches))

    def describe(self) -> str:
        names = [f.removeprefix("patches/llama.cpp/").split("-", 1)[0] for f, _ in self.patches]  # 0001, vulkan/0001
        return (f"dgr {self.version} ({self.source}{', Python deps ' + self.python if self.python else ''})\n"
                f"llama.cpp {self.commit}\n"
                f"patch series {self.patch_series} ({len(self.patches)} patches: {' '.join(names)})")


def release_root() -> Path | None:
    """The release folder this package runs from (it holds release.json), or None in a checkout."""
    return REPO_ROOT if (REPO_ROOT / "release.json").is_file() and (REPO_ROOT / "upstream.json").is_file() else None


@lru_cache(maxsize=1)
def build_info() -> BuildInfo:
    root = release_root()
    if root is not None:
        rel = json.loads((root / "release.json").read_text())
        up = json.loads((root / "upstream.json").read_text())
        return BuildInfo(version=rel["version"], source=f"release {rel['lane']}", commit=up["commit"],
                         patches=tuple((p["file"], p["blake3"]) for p in up["patches"]), python=rel.get("python", ""))
    packaged = Path(__file__).with_name("_build.json")  # an installed wheel (setup.py writes it)
    if packaged.is_file():
        facts = json.loads(packaged.read_text())
        return BuildInfo(version=__version__, source="installed", commit=facts["commit"],
                         patches=tuple((p["file"], p["blake3"]) for p in facts["patches"]))
    p = pin.load_pin()
    return BuildInfo(version=__version__, source="checkout", commit=p.commit,
                     patches=tuple((e.file, e.blake3) for e in p.patches))
