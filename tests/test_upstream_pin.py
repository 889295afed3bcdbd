"""The real pin: one file, never repeated, its patch list equal to patches/llama.cpp/."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from dgr.constants import LANES
from dgr import upstream

REPO = Path(__file__).resolve().parents[1]
PIN_REL = "toolchains/llama.cpp.pin.json"


def _pin_values() -> dict[str, str]:
    raw = json.loads((REPO / PIN_REL).read_text())
    values = {"commit": raw["commit"], "tree_hash": raw["tree_hash"]}
    for i, s in enumerate(raw["sources"]):
        values[f"sources[{i}].sha256"] = s["sha256"]
    return values


def test_the_pin_is_plain_json_with_every_field():
    pin = upstream.load_pin()
    assert pin.path == REPO / PIN_REL
    assert re.fullmatch(r"[0-9a-f]{40}", pin.commit)
    assert pin.tree_hash and re.fullmatch(r"[0-9a-f]{64}", pin.tree_hash)
    assert [s.kind for s in pin.sources][0] == "pypi-sdist"  # the source reachable from CI comes first
    for s in pin.sources:
        assert re.fullmatch(r"[0-9a-f]{64}", s.sha256) and s.strip_prefix
    for p in pin.patches:
        # the common stack, or a lane's own patch in patches/llama.cpp/<lane>/
        assert re.fullmatch(r"patches/llama\.cpp/((?:%s)/)?\d{4}-[^/]+\.patch" % "|".join(LANES), p.file)
        assert re.fullmatch(r"[0-9a-f]{64}", p.blake3)


def repeats_of_the_pin(repo: Path, values: dict[str, str]) -> list[str]:
    """Every tracked file (but the pin) that holds one of the pin's values, any case."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=repo, capture_output=True, check=True).stdout
    found = []
    for rel in files.decode().split("\0"):
        if not rel or rel == PIN_REL or not (repo / rel).is_file():
            continue
        data = (repo / rel).read_bytes().lower()
        found += [f"{rel} repeats the pin's {k}" for k, v in values.items() if v.encode() in data]
    return found


def test_the_pin_is_not_repeated_in_any_tracked_file():
    found = repeats_of_the_pin(REPO, _pin_values())
    assert not found, "read the value from the pin instead (docs/upstream.md): " + "; ".join(found)


def test_the_repeat_check_can_fail(tmp_path):
    # Negative control: a tracked file quoting the commit in upper case is caught.
    values = _pin_values()
    (tmp_path / "toolchains").mkdir()
    (tmp_path / PIN_REL).write_text(json.dumps(values))
    (tmp_path / "notes.txt").write_text(f"built from {values['commit'].upper()}\n")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "add", "-A"], cwd=tmp_path, check=True)
    assert repeats_of_the_pin(tmp_path, values) == ["notes.txt repeats the pin's commit"]


def test_the_pinned_listing_is_the_pinned_tree():
    # Bazel, Nix and dgr name the first differing file with it; it can only vouch for the pin's tree.
    pin = upstream.load_pin()
    listing = REPO / pin.tree_listing
    tracked = subprocess.run(["git", "ls-files", pin.tree_listing], cwd=REPO, capture_output=True, text=True)
    assert tracked.stdout.strip() == pin.tree_listing
    import blake3

    assert blake3.blake3(listing.read_bytes()).hexdigest() == pin.tree_hash
    assert len(listing.read_text().splitlines()) > 1000  # the whole build-relevant tree


def test_the_pins_patch_list_equals_the_patch_folder():
    pin = upstream.load_pin()
    upstream.check_patch_list(pin)  # raises, naming the patch, when they disagree
    assert [p.file for p in pin.patches] == upstream.patch_files_in_dir(pin)


def test_cli_checks_the_patch_list_and_prints_status():
    run = lambda *a: subprocess.run([sys.executable, "-m", "dgr", *a], capture_output=True, text=True)  # noqa: E731
    check = run("upstream", "pin-patches", "--check")
    assert check.returncode == 0, check.stderr
    assert "patch list matches patches/llama.cpp/" in check.stdout
    st = run("upstream", "status", "--json")
    assert st.returncode == 0, st.stderr
    assert json.loads(st.stdout)["commit"] == upstream.load_pin().commit
