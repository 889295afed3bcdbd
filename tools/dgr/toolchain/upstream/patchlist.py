"""The pin's patch list against patches/llama.cpp/: the same files, in name order, unchanged, lanes kept apart."""

from __future__ import annotations

import json
import os
from pathlib import Path

from dgr.core.constants import LANES
from dgr.core.errors import UpstreamError
from dgr.core.hashing import file_blake3
from dgr.toolchain.pin import PATCH_DIR_REL, Pin, load_pin, patch_lane


def patch_files_in_dir(pin: Pin) -> list[str]:
    """The patch files present, as repository-relative paths in apply order: the common stack by name
    (NNNN-topic), then each lane's own patches (patches/llama.cpp/<lane>/NNNN-topic.patch), lanes by name."""
    if not pin.patch_dir.is_dir():
        return []
    files = [f"{PATCH_DIR_REL}/{p.name}" for p in sorted(pin.patch_dir.glob("*.patch"))]
    for lane in sorted(LANES):
        files += [f"{PATCH_DIR_REL}/{lane}/{p.name}" for p in sorted((pin.patch_dir / lane).glob("*.patch"))]
    return files


def lane_dir(lane: str) -> str:
    """The only upstream folder a lane's own patch may touch: its ggml backend."""
    return f"ggml/src/ggml-{'hip' if lane == 'rocm' else lane}/"


def touched_files(patch: Path) -> list[str]:
    """Upstream paths a git-format patch changes (from its `diff --git a/X b/Y` lines)."""
    out = []
    for line in patch.read_text(errors="replace").splitlines():
        if line.startswith("diff --git a/"):
            a, _, b = line[len("diff --git a/"):].partition(" b/")
            out += [a, b]
    return out


def check_lane_patch(pin: Pin, file: str) -> None:
    """A lane's own patch touches only that lane's backend folder, so that applying it to the one
    shared tree leaves every other lane's sources byte-identical (docs/upstream.md, 'Lane patches')."""
    lane = patch_lane(file)
    if lane is None:
        return
    where = lane_dir(lane)
    outside = [f for f in touched_files(pin.root / file) if not f.startswith(where)]
    if outside:
        raise UpstreamError(
            f"{file}: a {lane}-lane patch may only change {where}, but it changes {', '.join(sorted(set(outside)))}; "
            f"move that change into the common stack ({PATCH_DIR_REL}/NNNN-topic.patch) or out of the patch"
        )


def check_patch_list(pin: Pin) -> None:
    """Fail when patches/llama.cpp/ and the pin's patch list disagree (names, order or bytes)."""
    listed = [p.file for p in pin.patches]
    present = patch_files_in_dir(pin)
    fix = "run `dgr upstream pin-patches` to rewrite the pin's list from the folder"
    for f in present:
        if f not in listed:
            raise UpstreamError(f"{f}: in {PATCH_DIR_REL}/ but not in {pin.path.name}'s patches; {fix}")
    for f in listed:
        if f not in present:
            raise UpstreamError(f"{f}: listed in {pin.path.name} but missing from {PATCH_DIR_REL}/; {fix}")
    if listed != present:
        raise UpstreamError(f"{pin.path.name}: patches are listed out of name order ({listed}); {fix}")
    for p in pin.patches:
        got = file_blake3(pin.root / p.file)
        if got != p.blake3:
            raise UpstreamError(
                f"{p.file}: blake3 {got} does not match the pin's {p.blake3}: the patch changed after it "
                f"was pinned; if the change is intended, {fix}"
            )
        check_lane_patch(pin, p.file)


def pin_patches(pin: Pin | None = None) -> list[dict[str, str]]:
    """Rewrite the pin's `patches` from patches/llama.cpp/*.patch (name order); returns the list."""
    pin = pin or load_pin()
    entries = []
    for f in patch_files_in_dir(pin):
        name = f.rsplit("/", 1)[1]
        if not (len(name) > 5 and name[:4].isdigit() and name[4] == "-"):
            raise UpstreamError(f"{f}: patch names must look like NNNN-topic.patch (applied in name order)")
        check_lane_patch(pin, f)
        entries.append({"file": f, "blake3": file_blake3(pin.root / f)})
    # The file as written (its key order and notes), with only `patches` replaced.
    raw = json.loads(pin.path.read_text())
    raw["patches"] = entries
    tmp = pin.path.with_name(pin.path.name + ".tmp")
    tmp.write_text(json.dumps(raw, indent=2) + "\n")
    os.replace(tmp, pin.path)
    return entries
