#!/usr/bin/env python3
"""Print the blake3 (hex) of each file given, one `<hash>  <path>` line each (like sha256sum); with
`--series PIN.json`, the pin's patch series hash instead (dgr.core.hashing.series_hash: the engine's numerics
name it, docs/numerics.md).

Used by toolchains/llama_cpp.bzl and nix/llama-cpp-src.nix to check every patch against the pin. It
runs before anything is built, where dgr is not installed, so it imports `dgr.core.hashing` (stdlib +
blake3) from the source tree: `tools/` of the repository this file is in.
"""

import os
import sys

_TOOLS = os.path.join(os.path.dirname(os.path.realpath(__file__)), os.pardir, os.pardir, "tools")
sys.path.insert(0, os.path.normpath(_TOOLS))

from dgr.core.hashing import file_blake3, series_hash  # noqa: E402


def main(paths: list[str]) -> int:
    if paths[:1] == ["--series"]:
        import json

        with open(paths[1]) as f:
            pin = json.load(f)
        print(series_hash([(p["file"], p["blake3"]) for p in pin.get("patches", [])]))
        return 0
    for path in paths:
        print(f"{file_blake3(path)}  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
