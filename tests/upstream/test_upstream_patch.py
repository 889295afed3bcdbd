"""Patching the pinned upstream: in pin order, idempotent, every patch checked and named."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dgr.core.errors import UpstreamError
from dgr.toolchain import upstream

from support.upstream import RangeHandler, format_patch, git, http_dir, tiny  # noqa: F401  (fixtures)

FIRST = ("Add a tiny hook", {"include/llama.h": "#pragma once\n#define TINY_LLAMA_VALUE 42\n"})
SECOND = ("Use the hook", {"src/llama.cpp": "#include \"llama.h\"\nint tiny_llama(void) { return TINY_LLAMA_VALUE + 1; }\n"})
# Only applies on top of FIRST (its context is the value 42).
THIRD = ("Bump the hook", {"include/llama.h": "#pragma once\n#define TINY_LLAMA_VALUE 43\n"})


def _pinned(tiny, edits) -> upstream.Pin:
    patch_dir = tiny["repo"] / "patches" / "llama.cpp"
    format_patch(tiny["tree"], edits, patch_dir)
    upstream.pin_patches(upstream.load_pin(tiny["pin"]))
    return upstream.load_pin(tiny["pin"])


def test_patches_apply_in_order_and_patching_is_idempotent(tiny):
    pin = _pinned(tiny, [FIRST, SECOND, THIRD])
    assert [p.file for p in pin.patches] == [
        "patches/llama.cpp/0001-Add-a-tiny-hook.patch",
        "patches/llama.cpp/0002-Use-the-hook.patch",
        "patches/llama.cpp/0003-Bump-the-hook.patch",
    ]
    out = upstream.ensure_patched(pin, tiny["ws"])
    assert out == tiny["ws"] / "upstream" / "llama.cpp"
    assert (out / "include" / "llama.h").read_text().endswith("VALUE 43\n")
    assert "VALUE + 1" in (out / "src" / "llama.cpp").read_text()
    log = git(out, "log", "--format=%s").splitlines()
    assert log == ["Bump the hook", "Use the hook", "Add a tiny hook", f"llama.cpp {pin.commit} (pristine, dgr pin)"]
    # The pristine tree is untouched.
    assert (tiny["ws"] / "upstream" / f"src-{pin.commit}" / "include" / "llama.h").read_text().endswith("41\n")
    head = git(out, "rev-parse", "HEAD")
    stamp = tiny["ws"] / "upstream" / "llama.cpp.stamp.json"
    stamp_mtime = stamp.stat().st_mtime_ns
    # Second run: same stamp, nothing to do (no new commits, stamp not rewritten).
    assert upstream.ensure_patched(pin, tiny["ws"]) == out
    assert upstream.patch(pin, tiny["ws"]) == out
    assert git(out, "rev-parse", "HEAD") == head and stamp.stat().st_mtime_ns == stamp_mtime
    st = upstream.status(pin, tiny["ws"])
    assert st["patches_current"] and len(st["patches_applied"]) == 3 and st["local_changes"] == []
    # Same inputs on another machine give the same commits (fixed identities and dates).
    other = tiny["ws"].parent / "ws2"
    assert git(upstream.ensure_patched(pin, other), "rev-parse", "HEAD") == head


def test_changed_patch_list_recreates_from_pristine(tiny):
    pin = _pinned(tiny, [FIRST, SECOND])
    out = upstream.ensure_patched(pin, tiny["ws"])
    assert "VALUE + 1" in (out / "src" / "llama.cpp").read_text()
    (tiny["repo"] / "patches" / "llama.cpp" / "0002-Use-the-hook.patch").unlink()
    with pytest.raises(UpstreamError, match="0002-Use-the-hook.patch: listed in .* but missing"):
        upstream.ensure_patched(upstream.load_pin(tiny["pin"]), tiny["ws"])
    upstream.pin_patches(upstream.load_pin(tiny["pin"]))
    out = upstream.ensure_patched(upstream.load_pin(tiny["pin"]), tiny["ws"])
    assert "VALUE + 1" not in (out / "src" / "llama.cpp").read_text()
    assert (out / "include" / "llama.h").read_text().endswith("42\n")


def test_a_modified_patch_byte_is_refused_naming_the_patch(tiny):
    pin = _pinned(tiny, [FIRST, SECOND])
    p = tiny["repo"] / "patches" / "llama.cpp" / "0002-Use-the-hook.patch"
    data = bytearray(p.read_bytes())
    data[data.index(b"+ 1")] = ord("-")
    p.write_bytes(bytes(data))
    with pytest.raises(UpstreamError) as err:
        upstream.ensure_patched(pin, tiny["ws"])
    msg = str(err.value)
    assert msg.startswith("patches/llama.cpp/0002-Use-the-hook.patch: blake3 ")
    assert "dgr upstream pin-patches" in msg
    assert not (tiny["ws"] / "upstream" / "llama.cpp").exists()


def test_a_patch_that_does_not_apply_names_itself_and_how_to_regenerate(tiny):
    # THIRD alone: made against a tree where the value is 42, the pin has 41.
    pin = _pinned(tiny, [FIRST, THIRD])
    (tiny["repo"] / "patches" / "llama.cpp" / "0001-Add-a-tiny-hook.patch").unlink()
    pin = upstream.load_pin(tiny["pin"])
    upstream.pin_patches(pin)
    pin = upstream.load_pin(tiny["pin"])
    with pytest.raises(UpstreamError) as err:
        upstream.ensure_patched(pin, tiny["ws"])
    msg = str(err.value)
    assert msg.startswith("patches/llama.cpp/0002-Bump-the-hook.patch does not apply to llama.cpp")
    assert "include/llama.h" in msg
    assert "git format-patch --zero-commit --no-signature" in msg and "docs/upstream.md" in msg
    assert not (tiny["ws"] / "upstream" / "llama.cpp").exists()


def test_local_edits_in_the_patched_tree_are_not_silently_discarded(tiny):
    pin = _pinned(tiny, [FIRST])
    out = upstream.ensure_patched(pin, tiny["ws"])
    (out / "src" / "llama.cpp").write_text("// work in progress\n")
    assert upstream.status(pin, tiny["ws"])["local_changes"] == ["src/llama.cpp"]
    format_patch(tiny["tree"], [SECOND], tiny["repo"] / "patches" / "llama.cpp" / "new")
    new = tiny["repo"] / "patches" / "llama.cpp" / "new" / "0001-Use-the-hook.patch"
    new.rename(tiny["repo"] / "patches" / "llama.cpp" / "0002-Use-the-hook.patch")
    upstream.pin_patches(upstream.load_pin(tiny["pin"]))
    pin = upstream.load_pin(tiny["pin"])
    with pytest.raises(UpstreamError, match="has local changes \\(src/llama.cpp\\).*--force"):
        upstream.patch(pin, tiny["ws"])
    out = upstream.patch(pin, tiny["ws"], force=True)
    assert "VALUE + 1" in (out / "src" / "llama.cpp").read_text()
    # A commit made in the tree (not yet exported as a patch) counts as local work too.
    (out / "src" / "llama.cpp").write_text("// committed work\n")
    git(out, "commit", "-qam", "wip")
    assert upstream.local_changes(out)[0].startswith("HEAD moved from ")
    (tiny["repo"] / "patches" / "llama.cpp" / "0002-Use-the-hook.patch").unlink()
    upstream.pin_patches(upstream.load_pin(tiny["pin"]))
    with pytest.raises(UpstreamError, match="HEAD moved"):
        upstream.patch(upstream.load_pin(tiny["pin"]), tiny["ws"])


def test_pin_patch_list_must_equal_the_folder(tiny):
    pin = _pinned(tiny, [FIRST])
    upstream.check_patch_list(pin)
    extra = tiny["repo"] / "patches" / "llama.cpp" / "0002-extra.patch"
    extra.write_text((tiny["repo"] / "patches" / "llama.cpp" / "0001-Add-a-tiny-hook.patch").read_text())
    with pytest.raises(UpstreamError, match="0002-extra.patch: in patches/llama.cpp/ but not in"):
        upstream.check_patch_list(pin)
    (tiny["repo"] / "patches" / "llama.cpp" / "bad-name.patch").write_text("x")
    with pytest.raises(UpstreamError, match="NNNN-topic.patch"):
        upstream.pin_patches(pin)
    (tiny["repo"] / "patches" / "llama.cpp" / "bad-name.patch").unlink()
    entries = upstream.pin_patches(pin)
    assert [e["file"] for e in entries][-1] == "patches/llama.cpp/0002-extra.patch"
    raw = json.loads(tiny["pin"].read_text())
    assert raw["patches"] == entries and raw["commit"] == pin.commit  # the rest of the pin is kept
    upstream.check_patch_list(upstream.load_pin(tiny["pin"]))


def test_concurrent_processes_share_one_fetch_and_one_patched_tree(tiny):
    _pinned(tiny, [FIRST])
    code = ("import sys, pathlib; from dgr.toolchain import upstream; "
            "print(upstream.ensure_patched(upstream.load_pin(sys.argv[1]), pathlib.Path(sys.argv[2])))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tiny["pin"]), str(tiny["ws"])],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [(p.communicate(), p.returncode) for p in procs]
    assert [rc for _, rc in outs] == [0, 0, 0], [err for (_, err), _ in outs]
    assert {out.strip() for (out, _), _ in outs} == {str(tiny["ws"] / "upstream" / "llama.cpp")}
    assert len(RangeHandler.seen) == 1  # downloaded once
    assert upstream.status(upstream.load_pin(tiny["pin"]), tiny["ws"])["patches_current"]


VK_FIX = ("Fix the vulkan backend", {"ggml/src/ggml-vulkan/ggml-vulkan.cpp": "int ggml_vk_tiny(void) { return 3; }\n"})


def test_a_lane_patch_comes_after_the_common_stack_and_touches_only_its_backend(tiny):
    """patches/llama.cpp/<lane>/ holds a lane's own patches (e.g. Vulkan's header guard): applied after
    the common stack, and refused when they reach outside ggml/src/ggml-<lane>/, since every lane
    shares the one patched tree."""
    lane_dir = tiny["repo"] / "patches" / "llama.cpp" / "vulkan"
    format_patch(tiny["tree"], [VK_FIX], lane_dir)
    pin = _pinned(tiny, [FIRST])
    assert [p.file for p in pin.patches] == [
        "patches/llama.cpp/0001-Add-a-tiny-hook.patch",
        "patches/llama.cpp/vulkan/0001-Fix-the-vulkan-backend.patch",
    ]
    out = upstream.ensure_patched(pin, tiny["ws"])
    assert (out / "ggml" / "src" / "ggml-vulkan" / "ggml-vulkan.cpp").read_text().endswith("return 3; }\n")
    assert git(out, "log", "--format=%s").splitlines()[:2] == ["Fix the vulkan backend", "Add a tiny hook"]

    # A "vulkan" patch that changes llama.h would change the CPU lane too: refused, named.
    for p in lane_dir.glob("*.patch"):
        p.unlink()
    format_patch(tiny["tree"], [("Sneak into llama.h", THIRD[1])], lane_dir)
    with pytest.raises(UpstreamError, match=r"vulkan/0001-Sneak-into-llama.h.patch: a vulkan-lane patch may only "
                                            r"change ggml/src/ggml-vulkan/, but it changes include/llama.h"):
        upstream.pin_patches(upstream.load_pin(tiny["pin"]))
