"""docs/upstream-proposals.md stays current with the pin: every patch it names is in the pinned stack (a pin bump
that renames or drops one fails here until the page follows)."""

from __future__ import annotations

import re

from dgr.toolchain.pin import load_pin

from support.paths import REPO

DOC = REPO / "docs" / "upstream-proposals.md"


def test_every_patch_the_proposals_name_is_in_the_pinned_stack():
    named = set(re.findall(r"patches/llama\.cpp/[\w./-]+\.patch", DOC.read_text()))
    pinned = {p.file for p in load_pin().patches}
    assert named, "docs/upstream-proposals.md names no patch"
    assert named <= pinned, f"named in docs/upstream-proposals.md but not pinned: {sorted(named - pinned)}"

