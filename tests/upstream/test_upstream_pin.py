"""The real pin: one file, never repeated, its patch list equal to patches/llama.cpp/."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dgr.core.constants import LANES
from dgr.core.errors import UpstreamError
from dgr.toolchain import pin as pins, upstream

from support.paths import REPO

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


def test_the_runtime_reads_the_pin_without_the_toolchain():
    # A worker names its engine (commit + patch series) from the pin; that must not import fetch/patch/build code.
    code = ("import sys; from dgr.toolchain.pin import load_pin, patch_series; p = load_pin(); print(patch_series(p)); "
            "print(sorted(m for m in sys.modules if m.startswith(('dgr.toolchain.upstream', 'dgr.toolchain.treehash', 'dgr.toolchain.enginebuild'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[1] == "[]"
    import blake3

    pin = pins.load_pin()
    h = blake3.blake3()
    for p in pin.patches:
        h.update(f"{p.file}\0{p.blake3}\n".encode())
    assert out[0] == pins.patch_series(pin) == h.hexdigest()


def test_the_pin_model_is_frozen():
    pin = pins.load_pin()
    with pytest.raises(Exception):
        pin.commit = "0" * 40
    assert pins.load_pin() == pin and hash(pin) == hash(pins.load_pin())


@pytest.mark.parametrize("change, message", [
    (lambda r: r["sources"][0].update(kind="git"), r"field sources\[0\]\.kind: is 'git'; known kinds: pypi-sdist, archive"),
    (lambda r: r["sources"][0].pop("filename"), r"field sources\[0\]\.filename: required field is missing"),
    (lambda r: r["sources"][0].update(url="x"), r"field sources\[0\]\.url: unknown field; remove it"),
    (lambda r: r.update(commit="abc"), r"field commit: must be a full 40-hex lowercase commit"),
    (lambda r: r.update(sources=[]), r"field sources: is empty; name at least one source"),
    (lambda r: r.update(tree_hash=7), r"field tree_hash: Input should be a valid string"),
    (lambda r: r["patches"][0].update(file="0001-x.patch"), r"field patches\[0\]\.file: must be patches/llama\.cpp/NNNN"),
    (lambda r: r["patches"][0].update(file="patches/llama.cpp/tpu/0001-x.patch"), r"field patches\[0\]\.file: .*lanes: "),
    (lambda r: r.pop("patches"), r"field patches: required field is missing"),
])
def test_pin_errors_name_the_file_the_field_and_the_fix(tmp_path, change, message):
    raw = json.loads((REPO / PIN_REL).read_text())
    change(raw)
    path = tmp_path / "llama.cpp.pin.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(UpstreamError, match=rf"^{re.escape(str(path))}: {message}"):
        pins.load_pin(path)


def test_a_missing_pin_says_where_it_should_be(tmp_path):
    with pytest.raises(UpstreamError, match=r"pin file not found .*toolchains/llama\.cpp\.pin\.json"):
        pins.load_pin(tmp_path / "nope.json")
