"""The pinned llama.cpp in the workspace: fetch it, verify it against the pin, patch it (docs/upstream.md).

One job per module: `layout` (where each state lives), `sources` (one source's archive, sha256
checked), `extract` (the tree-hash files of an archive), `pristine` (fetch and verify the tree),
`patchlist` (the pin's patch list against patches/llama.cpp/), `apply` (the patched git tree),
`state` (the status report), `fetchtree` (one source tree: first source, archive, extract, check) and
`vendored` (the C sources dgr-worker compiles in, BLAKE3, pinned the same way). The pin itself is `dgr.toolchain.pin`, which the runtime reads without this package.
"""

from dgr.toolchain.pin import PATCH_DIR_REL, PIN_PATH, PatchEntry, Pin, load_pin, patch_lane, patch_series
from dgr.toolchain.upstream.apply import GIT_ENV, apply_patches, ensure_patched, local_changes, patch, patch_stamp
from dgr.toolchain.upstream.layout import Layout, layout
from dgr.toolchain.upstream.patchlist import (check_lane_patch, check_patch_list, lane_dir, patch_files_in_dir,
                                              pin_patches, touched_files)
from dgr.toolchain.upstream.pristine import explain_tree, fetch, require_tree_hash, verify
from dgr.toolchain.upstream.sources import fetch_archive
from dgr.toolchain.upstream.state import status
from dgr.toolchain.upstream.vendored import BLAKE3_PIN, VendoredPin, fetch_vendored, load_vendored_pin

__all__ = [
    "BLAKE3_PIN", "GIT_ENV", "Layout", "PATCH_DIR_REL", "PIN_PATH", "PatchEntry", "Pin", "apply_patches", "check_lane_patch",
    "check_patch_list", "ensure_patched", "explain_tree", "fetch", "fetch_archive", "lane_dir", "layout",
    "load_pin", "local_changes", "patch", "patch_files_in_dir", "patch_lane", "patch_series", "patch_stamp",
    "pin_patches", "require_tree_hash", "status", "touched_files", "verify",
    "VendoredPin", "fetch_vendored", "load_vendored_pin",
]
