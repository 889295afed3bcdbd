"""The pristine tree: fetched from the first pinned source that works, verified against the pin's tree hash."""

from __future__ import annotations

import json
from pathlib import Path

from dgr.core.errors import UpstreamError
from dgr.core.locks import locked
from dgr.core.log import get_logger
from dgr.toolchain import treehash
from dgr.toolchain.pin import Pin, load_pin
from dgr.toolchain.upstream.fetchtree import fetch_tree
from dgr.toolchain.upstream.layout import Layout, layout

log = get_logger(__name__)


def require_tree_hash(pin: Pin) -> str:
    """The pin's tree hash, or an error saying how to compute it."""
    if not pin.tree_hash:
        raise UpstreamError(
            f"{pin.path}: tree_hash is null; compute it from a trusted copy with "
            "`python3 tools/dgr/toolchain/treehash.py DIR` and write it into the pin (docs/upstream.md, 'Updating the pin')"
        )
    return pin.tree_hash


def explain_tree(pin: Pin, entries: list[treehash.Entry], fallback: Path | None = None) -> str:
    """Name the first file of `entries` that differs from the pinned tree, when a listing says."""
    listings = ([pin.root / pin.tree_listing] if pin.tree_listing else []) + ([fallback] if fallback else [])
    for listing in listings:
        if listing.exists() and pin.tree_hash:
            return treehash.explain(listing, pin.tree_hash, entries)
    return "(no listing of the pinned tree to name the file)"


def fetch(pin: Pin | None = None, ws: Path | None = None) -> Path:
    """Fetch and verify the pristine tree (no-op when present). Returns upstream/src-<commit>/."""
    pin = pin or load_pin()
    lay = layout(pin, ws)
    if _fetched(pin, lay):
        return lay.pristine
    with locked(lay.upstream / ".fetch.lock"):
        return _fetch_locked(pin, lay)


def _fetched(pin: Pin, lay: Layout) -> bool:
    """A pristine tree is there, verified against this pin's tree hash when it was fetched."""
    if not (lay.pristine.is_dir() and lay.pristine_meta.exists()):
        return False
    return json.loads(lay.pristine_meta.read_text()).get("tree_hash") == pin.tree_hash


def _fetch_locked(pin: Pin, lay: Layout) -> Path:
    if _fetched(pin, lay):  # another process just made it
        return lay.pristine
    expected = require_tree_hash(pin)
    lay.upstream.mkdir(parents=True, exist_ok=True)
    lay.pristine_meta.unlink(missing_ok=True)

    def check(tree: Path) -> tuple[list[treehash.Entry], str]:
        entries = treehash.listing(tree)
        got = treehash.hash_listing(entries)
        if got != expected:
            raise UpstreamError(f"tree hash {got} does not match the pin's {expected}; " + explain_tree(pin, entries))
        return entries, got

    done = fetch_tree(pin.sources, pin.commit, lay.downloads, lay.pristine, keep=treehash.is_upstream_file,
                      check=check, what=f"llama.cpp {pin.commit}", pin_path=pin.path)
    entries, got = done.checked
    lay.pristine_listing.write_text(treehash.listing_text(entries))
    meta = {"commit": pin.commit, "source": done.source.describe(), "archive": done.archive.name,
            "sha256": done.source.sha256, "tree_hash": got, "files": done.files,
            "fetch_seconds": done.seconds}
    lay.pristine_meta.write_text(json.dumps(meta, indent=2) + "\n")
    log.info("llama.cpp %s from %s: %d files, tree hash verified", pin.commit[:12], done.source.describe(), done.files)
    return lay.pristine


def verify(pin: Pin | None = None, ws: Path | None = None) -> str:
    """Recompute the pristine tree's hash; raise naming the first differing file. Returns the hash."""
    pin = pin or load_pin()
    lay = layout(pin, ws)
    expected = require_tree_hash(pin)
    if not lay.pristine.is_dir():
        raise UpstreamError(f"{lay.pristine}: not fetched; run `dgr upstream fetch`")
    entries = treehash.listing(lay.pristine)
    got = treehash.hash_listing(entries)
    if got != expected:
        msg = f"{lay.pristine}: tree hash {got} does not match the pin's {expected}; "
        msg += explain_tree(pin, entries, fallback=lay.pristine_listing)
        raise UpstreamError(msg + "; delete the folder and run `dgr upstream fetch` to restore it")
    return got
