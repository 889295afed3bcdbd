#!/usr/bin/env python3
"""The tree hash of an upstream llama.cpp source tree: one blake3 over a canonical file listing.

Every source named by the pin (PyPI sdist, GitHub archive, ...) must reproduce the pin's
`tree_hash`. dgr, Bazel's repository rule and Nix all call this file, so it depends on the
standard library, `blake3` and `dgr.core.hashing` only (imported from the source tree beside it when
dgr is not installed), and runs as a script:

    python3 tools/dgr/toolchain/treehash.py DIR                  # prints the tree hash
    python3 tools/dgr/toolchain/treehash.py DIR --expect HASH    # exit 1 on mismatch (expected vs got)
    python3 tools/dgr/toolchain/treehash.py DIR --listing        # prints the canonical listing
    python3 tools/dgr/toolchain/treehash.py DIR --expect HASH --expect-listing toolchains/llama.cpp.tree.txt
                                                       # also names the first differing file

Which files count (rules version 1; changing them changes every hash: bump RULES_VERSION and
re-pin). Kept: the inputs of llama.cpp's CMake build of its libraries and tools, that is the
top-level `CMakeLists.txt` and `LICENSE` and everything under `cmake/ common/ ggml/ include/
licenses/ src/ tools/ vendor/`, except
  - any path with a component starting with `.git` (`.git` itself, `.gitignore`, `.gitmodules`:
    a packager adds or drops these; the sdist carries a `.git` pointer file);
  - `*.md` anywhere (documentation; editing it must not change the tree);
  - `tools/ui/` (the web UI: its build needs npm, and the sdist drops files its nested
    `.gitignore` matches, e.g. `static/favicon.svg`, that the GitHub archive keeps);
  - `__pycache__/`, `*.pyc`, `.DS_Store` (made by tools, never tracked).
Left out entirely: docs/, examples/, tests/, pocs/, models/ (large vocab GGUFs), gguf-py/, scripts/
and the top-level Python and CI files; dgr builds with LLAMA_BUILD_TESTS/EXAMPLES off.

The listing has one line per file, sorted by the UTF-8 bytes of the path:
    "<blake3 of the content, hex> <mode> <path relative to DIR, '/'-separated>\n"
where mode is `x` (any execute bit set), `-` (regular) or `l` (a symlink; the digest is the blake3
of its target string). Timestamps, owners and empty directories do not count. The tree hash is
the blake3 (hex) of the listing's UTF-8 bytes.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and not __package__:
    # Run as a script (Bazel's repository rule, Nix), where dgr is not installed: import dgr.core.hashing
    # from the source tree. The script's own folder leaves sys.path: it holds dgr's modules, whose
    # names must not stand in for the standard library's.
    _here = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != _here]
    sys.path.insert(0, os.path.dirname(os.path.dirname(_here)))  # tools/

import argparse  # noqa: E402
import stat  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable, Iterable, NamedTuple  # noqa: E402

from dgr.core.hashing import bytes_blake3, file_blake3  # noqa: E402

RULES_VERSION = 1

INCLUDE_FILES = ("CMakeLists.txt", "LICENSE")
INCLUDE_DIRS = ("cmake", "common", "ggml", "include", "licenses", "src", "tools", "vendor")
EXCLUDE_PREFIXES = ("tools/ui/",)
EXCLUDE_NAMES = ("__pycache__", ".DS_Store")
EXCLUDE_SUFFIXES = (".md", ".pyc")


class Entry(NamedTuple):
    path: str  # relative, '/'-separated
    mode: str  # 'x', '-' or 'l'
    digest: str  # blake3 hex

    def line(self) -> str:
        return f"{self.digest} {self.mode} {self.path}\n"


def is_upstream_file(rel: str) -> bool:
    """True when `rel` (a '/'-separated path relative to the tree root) counts for the tree hash."""
    parts = rel.split("/")
    if any(p.startswith(".git") or p in EXCLUDE_NAMES for p in parts):
        return False
    if rel.endswith(EXCLUDE_SUFFIXES) or rel.startswith(EXCLUDE_PREFIXES):
        return False
    if len(parts) == 1:
        return rel in INCLUDE_FILES
    return parts[0] in INCLUDE_DIRS


def any_file(rel: str) -> bool:
    """Selection for project trees (e.g. worker/): everything but VCS files, docs and bytecode."""
    parts = rel.split("/")
    if any(p.startswith(".git") or p in EXCLUDE_NAMES for p in parts):
        return False
    return not rel.endswith(EXCLUDE_SUFFIXES)


def listing(root: Path | str, select: Callable[[str], bool] = is_upstream_file) -> list[Entry]:
    """The canonical listing of the selected files under `root`, sorted by path bytes."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: not a directory")
    entries: list[Entry] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        rel_dir = "" if rel_dir == "." else rel_dir.replace(os.sep, "/") + "/"
        # Prune excluded directories early (a symlinked directory is listed as a link, not walked).
        keep = []
        for d in dirnames:
            full = os.path.join(dirpath, d)
            if os.path.islink(full):
                filenames.append(d)
            elif _dir_may_hold(rel_dir + d, select):
                keep.append(d)
        dirnames[:] = keep
        for name in filenames:
            rel = rel_dir + name
            if "\n" in rel or not select(rel):
                continue
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                entries.append(Entry(rel, "l", bytes_blake3(os.readlink(full).encode())))
            elif stat.S_ISREG(st.st_mode):
                mode = "x" if st.st_mode & 0o111 else "-"
                # Sources are small and many: one thread each (a thread pool per file costs more).
                entries.append(Entry(rel, mode, file_blake3(full, threads=False)))
            else:
                raise ValueError(f"{full}: not a regular file or symlink; a source tree holds only those")
    entries.sort(key=lambda e: e.path.encode())
    return entries


def _dir_may_hold(rel_dir: str, select: Callable[[str], bool]) -> bool:
    # A directory is walked when a file directly inside it could be selected.
    return select(rel_dir + "/probe")


def listing_text(entries: Iterable[Entry]) -> str:
    return "".join(e.line() for e in entries)


def hash_listing(entries: Iterable[Entry]) -> str:
    return bytes_blake3(listing_text(entries).encode())


def tree_hash(root: Path | str, select: Callable[[str], bool] = is_upstream_file) -> str:
    """The tree hash of `root` (see the module docstring for the rules)."""
    return hash_listing(listing(root, select))


def parse_listing(text: str) -> list[Entry]:
    entries = []
    for line in text.splitlines():
        digest, mode, path = line.split(" ", 2)
        entries.append(Entry(path, mode, digest))
    return entries


def first_difference(expected: list[Entry], got: list[Entry]) -> str | None:
    """Names the first path that differs between two listings (changed, added or removed)."""
    exp = {e.path: e for e in expected}
    have = {e.path: e for e in got}
    for path in sorted(set(exp) | set(have), key=str.encode):
        a, b = exp.get(path), have.get(path)
        if a == b:
            continue
        if a is None:
            return f"{path}: added (not in the expected listing)"
        if b is None:
            return f"{path}: removed (expected in the listing)"
        if a.digest != b.digest:
            return f"{path}: content changed (blake3 {a.digest[:16]}... expected, {b.digest[:16]}... got)"
        return f"{path}: mode changed ({a.mode!r} expected, {b.mode!r} got)"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="treehash.py",
        description=f"Tree hash of an upstream llama.cpp source tree (rules v{RULES_VERSION}).",
    )
    p.add_argument("dir", type=Path, help="the source tree (the archive's strip_prefix folder)")
    p.add_argument("--expect", metavar="HASH", help="exit 1 unless the tree hash equals HASH")
    p.add_argument("--expect-listing", metavar="FILE", type=Path,
                   help="with --expect: a listing (from --listing) to name the first differing file")
    p.add_argument("--listing", action="store_true", help="print the canonical listing, not the hash")
    args = p.parse_args(argv)
    try:
        entries = listing(args.dir)
    except (OSError, ValueError) as err:
        print(f"treehash.py: error: {err}", file=sys.stderr)
        return 2
    if args.listing:
        sys.stdout.write(listing_text(entries))
        return 0
    got = hash_listing(entries)
    if args.expect is None:
        print(got)
        return 0
    if got == args.expect.strip().lower():
        print(got)
        return 0
    msg = f"treehash.py: {args.dir}: tree hash mismatch: expected {args.expect}, got {got}"
    if args.expect_listing:
        msg += "; " + explain(args.expect_listing, args.expect.strip().lower(), entries)
    print(msg, file=sys.stderr)
    return 1


def explain(listing_file: Path, expected_hash: str, entries: list[Entry]) -> str:
    """Name the first file that differs from a stored listing, trusting it only if it hashes to
    `expected_hash` (so a listing kept beside the pin can never vouch for a different tree)."""
    try:
        text = Path(listing_file).read_text()
    except OSError as err:
        return f"(listing unreadable: {err})"
    if bytes_blake3(text.encode()) != expected_hash:
        return f"(listing {listing_file} is not the expected tree's listing; cannot name the file)"
    diff = first_difference(parse_listing(text), entries)
    return f"first difference: {diff}" if diff else "(no file differs?)"


if __name__ == "__main__":
    sys.exit(main())
