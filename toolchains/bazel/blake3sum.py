#!/usr/bin/env python3
"""Print the blake3 (hex) of each file given, one `<hash>  <path>` line each (like sha256sum).

Used by toolchains/llama_cpp.bzl to check every patch against the pin; stdlib + blake3 only, so it
runs in a Bazel repository rule before anything is built.
"""

import sys

import blake3


def main(paths: list[str]) -> int:
    for path in paths:
        h = blake3.blake3()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        print(f"{h.hexdigest()}  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
