"""The tree hash: any change to a build-relevant file changes it, and the difference is named."""

from __future__ import annotations

import subprocess
import sys

from dgr.toolchain import treehash

from support.upstream import BUILD_FILES, TREEHASH_SCRIPT, make_tree


def _hash_and_listing(tree):
    entries = treehash.listing(tree)
    return treehash.hash_listing(entries), entries


def test_one_changed_byte_changes_the_hash_and_is_named(tmp_path):
    tree = make_tree(tmp_path / "t")
    before, old = _hash_and_listing(tree)
    p = tree / "src" / "llama.cpp"
    data = bytearray(p.read_bytes())
    data[10] ^= 0x01
    p.write_bytes(bytes(data))
    after, new = _hash_and_listing(tree)
    assert after != before
    diff = treehash.first_difference(old, new)
    assert diff.startswith("src/llama.cpp: content changed")


def test_added_and_removed_files_change_the_hash(tmp_path):
    tree = make_tree(tmp_path / "t")
    base, old = _hash_and_listing(tree)
    (tree / "src" / "extra.cpp").write_text("int x;\n")
    added, new = _hash_and_listing(tree)
    assert added != base
    assert treehash.first_difference(old, new) == "src/extra.cpp: added (not in the expected listing)"
    (tree / "src" / "extra.cpp").unlink()
    assert treehash.tree_hash(tree) == base
    (tree / "ggml" / "src" / "ggml.c").unlink()
    removed, new = _hash_and_listing(tree)
    assert removed != base
    assert treehash.first_difference(old, new) == "ggml/src/ggml.c: removed (expected in the listing)"


def test_execute_bit_counts_but_timestamps_do_not(tmp_path):
    tree = make_tree(tmp_path / "t")
    base = treehash.tree_hash(tree)
    import os

    os.utime(tree / "CMakeLists.txt", (1, 1))
    assert treehash.tree_hash(tree) == base
    (tree / "tools" / "run.sh").chmod(0o644)
    assert treehash.tree_hash(tree) != base


def test_files_a_packager_may_add_or_drop_do_not_count(tmp_path):
    tree = make_tree(tmp_path / "t")
    base = treehash.tree_hash(tree)
    (tree / ".git").write_text("gitdir: ../../.git/modules/vendor/llama.cpp\n")  # the sdist's pointer
    (tree / "ggml" / ".gitignore").write_text("build/\n")
    (tree / "src" / "NOTES.md").write_text("notes\n")
    (tree / "docs" / "other.txt").write_text("x\n")
    (tree / "examples").mkdir()
    (tree / "examples" / "main.cpp").write_text("int main(){}\n")
    (tree / "tools" / "ui" / "static" / "logo.svg").write_text("<svg/>\n")
    (tree / "src" / "__pycache__").mkdir()
    (tree / "src" / "__pycache__" / "x.pyc").write_bytes(b"\0")
    assert treehash.tree_hash(tree) == base


def test_symlink_is_hashed_by_its_target(tmp_path):
    tree = make_tree(tmp_path / "t")
    (tree / "include" / "alias.h").symlink_to("llama.h")
    first = treehash.tree_hash(tree)
    (tree / "include" / "alias.h").unlink()
    (tree / "include" / "alias.h").symlink_to("../src/llama.cpp")
    assert treehash.tree_hash(tree) != first
    assert [e.mode for e in treehash.listing(tree) if e.path == "include/alias.h"] == ["l"]


def test_script_expect_says_expected_and_got_and_names_the_file(tmp_path):
    tree = make_tree(tmp_path / "t")
    good = treehash.tree_hash(tree)
    listing = tmp_path / "listing.txt"
    run = lambda *a: subprocess.run([sys.executable, "-I", str(TREEHASH_SCRIPT), *map(str, a)],  # noqa: E731
                                    capture_output=True, text=True, cwd=tmp_path)
    assert run(tree, "--expect", good).returncode == 0
    listing.write_text(run(tree, "--listing").stdout)
    (tree / "include" / "llama.h").write_text("#pragma once\n#define TINY_LLAMA_VALUE 40\n")
    bad = run(tree, "--expect", good, "--expect-listing", listing)
    assert bad.returncode == 1
    assert f"expected {good}" in bad.stderr
    assert f"got {treehash.tree_hash(tree)}" in bad.stderr
    assert "include/llama.h: content changed" in bad.stderr
    missing = run(tmp_path / "nope")
    assert missing.returncode == 2 and "not a directory" in missing.stderr


def test_script_does_not_trust_a_listing_of_another_tree(tmp_path):
    tree = make_tree(tmp_path / "t")
    good = treehash.tree_hash(tree)
    other = tmp_path / "other.txt"
    other.write_text("0" * 64 + " - src/llama.cpp\n")  # claims a file differs, but is not good's listing
    (tree / "src" / "llama.cpp").write_text("changed\n")
    bad = subprocess.run([sys.executable, "-I", str(TREEHASH_SCRIPT), str(tree), "--expect", good,
                          "--expect-listing", str(other)], capture_output=True, text=True)
    assert bad.returncode == 1
    assert "is not the expected tree's listing" in bad.stderr and "first difference" not in bad.stderr


def _source_tree_copy(tmp_path):
    """tools/dgr's hashing scripts and what they import, copied into a bare tree, with a dgr.core.hashing that
    says where it was imported from: the scripts must take it from beside them, not an installed dgr."""
    from support.upstream import REPO

    root = tmp_path / "src"
    for folder in ("tools/dgr/core", "tools/dgr/toolchain", "toolchains/bazel"):
        (root / folder).mkdir(parents=True)
    for rel in ("tools/dgr/__init__.py", "tools/dgr/core/__init__.py", "tools/dgr/toolchain/treehash.py",
                "toolchains/bazel/blake3sum.py"):
        (root / rel).write_bytes((REPO / rel).read_bytes())
    hashing = (REPO / "tools/dgr/core/hashing.py").read_text()
    (root / "tools/dgr/core/hashing.py").write_text(hashing + "\nimport sys\nprint('hashing:', __file__, file=sys.stderr)\n")
    return root


def test_the_scripts_run_where_dgr_is_not_installed(tmp_path):
    # Bazel's repository rule and Nix run them from the source tree, outside any environment with dgr.
    import os

    from dgr.core.hashing import file_blake3

    root = _source_tree_copy(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = lambda *a: subprocess.run([sys.executable, *a], capture_output=True, text=True, cwd=tmp_path, env=env)  # noqa: E731
    helped = run(str(root / "tools/dgr/toolchain/treehash.py"), "--help")
    assert helped.returncode == 0 and "--expect" in helped.stdout, helped.stderr
    tree = make_tree(tmp_path / "t")
    hashed = run("-I", str(root / "tools/dgr/toolchain/treehash.py"), str(tree))
    assert hashed.stdout.strip() == treehash.tree_hash(tree), hashed.stderr
    assert f"hashing: {root / 'tools/dgr/core/hashing.py'}" in hashed.stderr
    target = tree / "src" / "llama.cpp"
    summed = run(str(root / "toolchains/bazel/blake3sum.py"), str(target))
    assert summed.returncode == 0, summed.stderr
    assert summed.stdout == f"{file_blake3(target)}  {target}\n"
    assert f"hashing: {root / 'tools/dgr/core/hashing.py'}" in summed.stderr


def test_tiny_upstream_hashes_alike_in_module_and_script(tmp_path):
    tree = make_tree(tmp_path / "tree")
    out = subprocess.run([sys.executable, "-I", str(TREEHASH_SCRIPT), str(tree)], capture_output=True,
                         text=True, cwd=tmp_path, check=True)
    assert out.stdout.strip() == treehash.tree_hash(tree)
    listed = [e.path for e in treehash.listing(tree)]
    assert listed == BUILD_FILES
