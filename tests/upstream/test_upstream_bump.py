"""`dgr upstream bump`: a pin bump as a procedure. The new source is verified, the patch stack re-applied
(three-way where it can; every hunk that does not apply named with its patch and file), the engine built in
a scratch folder, the checks run, and the pin written only with --write when every step passed.

Fast tests use a stand-in repository (a pin, patches made with `git format-patch`, a stand-in CMake
project) over a small upstream served on loopback; the slow ones use the real pin and its patch stack.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from dgr.cli.main import main
from dgr.core.errors import UpstreamError
from dgr.core.hashing import file_sha256
from dgr.toolchain import treehash, upstream
from dgr.toolchain.upstream import bump, newsource, restack
from dgr.toolchain.upstream.bumpchecks import Step

from support.upstream import FAKE_COMMIT, format_patch, git, http_dir, make_tarball, make_tree, write_pin  # noqa: F401

# A small upstream whose src/llama.cpp is long enough for a three-way merge to matter.
BODY = [f"int f{i}(void) {{ return {i}; }}" for i in range(12)]
FILES = {
    "CMakeLists.txt": "# small upstream\n",
    "include/llama.h": "#pragma once\n#define TINY_LLAMA_VALUE 41\n",
    "src/llama.cpp": "\n".join(BODY) + "\n",
    "ggml/src/ggml.c": "int ggml_tiny(void) { return 1; }\n",
    "README.md": "# not build-relevant\n",
}
HOOK = ("Add a tiny hook", {"include/llama.h": "#pragma once\n#define TINY_LLAMA_VALUE 42\n"})
USE = ("Use the hook", {"src/llama.cpp": "\n".join(BODY[:8] + ["int f8(void) { return TINY_LLAMA_VALUE; }"] + BODY[9:])
                        + "\n"})
NEW_COMMIT = "cd" * 20
ARCHIVE_SHA = "ef" * 32


@pytest.fixture
def repo(tmp_path, http_dir):  # noqa: F811
    """A stand-in repository pinning the small upstream (served over loopback) with two patches."""
    served, base = http_dir
    tree = make_tree(tmp_path / "tree", FILES)
    prefix = f"llama.cpp-{FAKE_COMMIT}"
    tarball = make_tarball(tree, prefix, served / "small.tar.gz")
    root = tmp_path / "repo"
    source = {"kind": "archive", "url": f"{base}/small.tar.gz", "sha256": file_sha256(tarball), "strip_prefix": prefix}
    pin_path = write_pin(root, [source], treehash.tree_hash(tree))
    format_patch(tree, [HOOK, USE], root / "patches" / "llama.cpp")
    upstream.pin_patches(upstream.load_pin(pin_path))
    return {"tree": tree, "root": root, "pin": pin_path, "ws": tmp_path / "ws", "tmp": tmp_path}


def _new_tree(repo, name: str, changes: dict[str, str]):
    """A copy of the pinned tree with `changes`: the llama.cpp a bump moves to (a plain folder)."""
    dest = repo["tmp"] / name
    shutil.copytree(repo["tree"], dest)
    for rel, text in changes.items():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_text(text)
    return dest


def _passing(name):
    def check(ctx, step: Step) -> None:
        step.ok(f"{name} (stand-in)")
    return (name, check)


STANDIN_CHECKS = [_passing("build"), _passing("families"), _passing("v4-splits"), _passing("gate")]


def _bump(repo, source, checks=None, **opts):
    pin = upstream.load_pin(repo["pin"])
    return bump.bump(str(source), bump.Options(**opts), pin=pin, ws=repo["ws"], checks=checks)


def test_a_broken_hunk_is_named_and_the_pin_stays(repo):
    pin_before = repo["pin"].read_bytes()
    # upstream changed the line the first patch edits: neither a plain nor a three-way apply can take it
    new = _new_tree(repo, "new", {"include/llama.h": "#pragma once\n#define TINY_LLAMA_VALUE 40\n"})
    res = _bump(repo, new, commit=NEW_COMMIT, checks=STANDIN_CHECKS, write=True)
    assert not res.passed and res.step("source").status == "passed"
    first, second = res.patches
    assert first.how == "failed" and second.how == "clean"
    [f] = first.failures
    assert (f.file, f.hunk, f.hunks) == ("include/llama.h", 1, 1)
    assert f.header.startswith("@@ -1,2 +1,2 @@")
    assert "`#define TINY_LLAMA_VALUE 41`" in f.why
    patches = res.step("patches")
    assert patches.status == "failed" and "0001" in patches.summary
    assert "0001-Add-a-tiny-hook.patch: DOES NOT APPLY: 1 hunk(s)" in patches.lines
    assert [s.status for s in res.steps[2:]] == ["not run"] * 4 + ["failed"]  # the checks, then write
    assert res.refusal and "patches failed" in res.refusal
    assert repo["pin"].read_bytes() == pin_before
    text = bump.report_text(res)
    assert "hunk 1/1 of include/llama.h (@@ -1,2 +1,2 @@" in text and "nothing written" in text
    report = json.loads((res.scratch / "report.json").read_text())
    assert report["patches"][0]["failures"][0]["file"] == "include/llama.h"
    # the scratch folder is named after the commit; the checkout's workspace build is never made
    assert res.scratch == repo["ws"] / "upstream-bump" / f"tree-{NEW_COMMIT[:12]}"
    assert not (repo["ws"] / "build").exists()


def test_the_cli_names_patch_hunk_and_file_and_exits_1(repo, monkeypatch, capfd):
    monkeypatch.setattr(bump, "load_pin", lambda path=None: upstream.load_pin(repo["pin"]))
    monkeypatch.setenv("DGR_WORKSPACE", str(repo["ws"]))
    edited = BODY[:7] + ["int f7(int x) { return x; }", "int f8(int x) { return x; }"] + BODY[9:]
    new = _new_tree(repo, "new", {"src/llama.cpp": "\n".join(edited) + "\n"})
    assert main(["upstream", "bump", str(new), "--commit", NEW_COMMIT, "--patches-only"]) == 1
    out = capfd.readouterr().out
    assert "0002-Use-the-hook.patch: DOES NOT APPLY" in out
    assert "hunk 1/1 of src/llama.cpp (@@ -6,7 +6,7 @@" in out
    assert "`int f8(void) { return 8; }`" in out


def test_a_no_op_bump_passes_its_source_and_patch_checks(repo):
    res = _bump(repo, repo["tree"], commit=FAKE_COMMIT, checks=STANDIN_CHECKS)
    assert res.new.tree_hash == upstream.load_pin(repo["pin"]).tree_hash
    assert res.passed and [p.how for p in res.patches] == ["clean", "clean"]
    assert "a no-op bump" in res.step("source").summary
    # the scratch pin: the same commit, tree hash and patch hashes; its workspace's tree was patched by
    # dgr.toolchain.upstream.apply as the checkout's would be
    spin = upstream.load_pin(res.scratch / "repo" / "toolchains" / "llama.cpp.pin.json")
    pin = upstream.load_pin(repo["pin"])
    assert (spin.commit, spin.tree_hash, spin.patches) == (pin.commit, pin.tree_hash, pin.patches)
    patched = upstream.ensure_patched(spin, res.scratch / "ws")
    assert (patched / "include" / "llama.h").read_text().endswith("42\n")


def test_a_no_op_write_keeps_the_pins_sources_and_patches(repo):
    before = upstream.load_pin(repo["pin"])
    res = _bump(repo, repo["tree"], commit=FAKE_COMMIT, checks=STANDIN_CHECKS, write=True)
    assert res.passed and res.step("write").status == "passed"
    assert not any(f.startswith("patches/") for f in res.written)  # the stack is unchanged
    after = upstream.load_pin(repo["pin"])
    assert (after.commit, after.tree_hash, after.sources, after.patches) == \
        (before.commit, before.tree_hash, before.sources, before.patches)
    # the listing is written (this stand-in pin had none): it vouches for the same tree
    assert after.tree_listing == "toolchains/llama.cpp.tree.txt"
    again = _bump(repo, repo["tree"], commit=FAKE_COMMIT, checks=STANDIN_CHECKS, write=True)
    assert again.passed and again.written == []
    assert "already say this" in bump.report_text(again)


def test_write_refuses_while_a_check_failed(repo):
    pin_before = repo["pin"].read_bytes()
    failing = [_passing("build"), ("families", lambda ctx, step: step.fail("granite_swa x3 DIFFERS")),
               _passing("v4-splits"), _passing("gate")]
    res = _bump(repo, repo["tree"], commit=FAKE_COMMIT, archive_sha256=ARCHIVE_SHA, checks=failing, write=True)
    assert not res.passed and not res.written
    assert res.step("write").status == "failed" and "families failed (granite_swa x3 DIFFERS)" in res.refusal
    assert repo["pin"].read_bytes() == pin_before
    # a partial run never writes: refused before anything runs
    with pytest.raises(UpstreamError, match="--write needs the full run; drop --skip-gate"):
        _bump(repo, repo["tree"], commit=FAKE_COMMIT, write=True, skip_gate=True)
    with pytest.raises(UpstreamError, match="drop --families"):
        _bump(repo, repo["tree"], commit=FAKE_COMMIT, write=True, families=["llama"])
    assert repo["pin"].read_bytes() == pin_before


def test_a_folder_nobody_can_fetch_is_not_pinned(repo):
    pin_before = repo["pin"].read_bytes()
    new = _new_tree(repo, "new", {"ggml/src/ggml.c": "int ggml_tiny(void) { return 2; }\n"})
    res = _bump(repo, new, commit=NEW_COMMIT, release="b2", checks=STANDIN_CHECKS, write=True)
    assert res.step("patches").status == "passed" and not res.written
    assert "--archive-sha256" in res.refusal
    assert repo["pin"].read_bytes() == pin_before


def test_three_way_regenerates_the_patch_and_write_moves_the_pin(repo):
    # upstream edited a line inside the second patch's context: a plain apply fails, a three-way merge is clean
    changed = "\n".join(BODY[:6] + ["int f6(void) { return 60; }"] + BODY[7:]) + "\n"
    new = _new_tree(repo, "new", {"src/llama.cpp": changed, "src/added.c": "int added;\n"})
    res = _bump(repo, new, commit=NEW_COMMIT, release="b2", archive_sha256=ARCHIVE_SHA, checks=STANDIN_CHECKS,
                write=True)
    assert [p.how for p in res.patches] == ["clean", "three-way"]
    assert res.passed and res.step("write").status == "passed"
    second = repo["root"] / "patches" / "llama.cpp" / "0002-Use-the-hook.patch"
    assert "patches/llama.cpp/0002-Use-the-hook.patch" in res.written
    pin = upstream.load_pin(repo["pin"])
    assert (pin.commit, pin.release) == (NEW_COMMIT, "b2")
    assert pin.tree_hash == treehash.tree_hash(new)
    assert [s.kind for s in pin.sources] == ["archive"] and pin.sources[0].sha256 == ARCHIVE_SHA
    upstream.check_patch_list(pin)  # the patch hashes are those of the files written
    # the regenerated patch keeps its header and message, and applies plainly to the new tree
    text = second.read_text()
    assert text.startswith("From 0000000000000000000000000000000000000000") and "Why: a hook the tests need." in text
    work = repo["tmp"] / "check"
    shutil.copytree(new, work)
    git(work, "init", "-q")
    git(work, "apply", str(repo["root"] / "patches" / "llama.cpp" / "0001-Add-a-tiny-hook.patch"))
    git(work, "apply", "--check", str(second))
    listing = (repo["root"] / "toolchains" / "llama.cpp.tree.txt").read_text()
    assert "src/added.c" in listing and treehash.hash_listing(treehash.parse_listing(listing)) == pin.tree_hash


def test_a_fixed_series_from_the_scratch_repository_passes(repo):
    new = _new_tree(repo, "new", {"include/llama.h": "#pragma once\n#define TINY_LLAMA_VALUE 40\n"})
    res = _bump(repo, new, commit=NEW_COMMIT, patches_only=True)
    assert [p.how for p in res.patches] == ["failed", "clean"]
    # the maintainer's fix, in a clone of the scratch repository: redo the failed change, drop the mark
    fix = repo["tmp"] / "fix"
    subprocess.run(["git", "clone", "-q", str(res.scratch / "restack"), str(fix)], check=True)
    with pytest.raises(UpstreamError, match="still marked PARTIAL"):
        _bump(repo, new, commit=NEW_COMMIT, patches_only=True, patches=fix)
    git(fix, "checkout", "-q", "-B", "fixed", "dgr-pristine")
    (fix / "include" / "llama.h").write_text("#pragma once\n#define TINY_LLAMA_VALUE 42\n")
    git(fix, "commit", "-qam", "Add a tiny hook\n\nWhy: a hook the tests need.")
    git(fix, "cherry-pick", "dgr-new")  # the second patch (the tip of the bump's branch), unchanged
    res = _bump(repo, new, commit=NEW_COMMIT, patches_only=True, patches=fix)
    assert [p.how for p in res.patches] == ["clean", "clean"]
    assert res.step("patches").status == "passed" and res.step("build").status == "skipped"
    assert (res.scratch / "series" / "0001-Add-a-tiny-hook.patch").is_file()


def test_a_git_folder_must_be_clean_and_names_its_commit(repo):
    new = _new_tree(repo, "gitnew", {"ggml/src/ggml.c": "int ggml_tiny(void) { return 3; }\n"})
    git(new, "init", "-q")
    git(new, "add", "-A")
    git(new, "commit", "-qm", "upstream")
    head = git(new, "rev-parse", "HEAD").strip()
    res = _bump(repo, new, patches_only=True)
    assert res.new.commit == head
    assert any("equal llama.cpp" in c and "own git tree" in c for c in res.step("source").lines)
    (new / "src" / "llama.cpp").write_text("int edited;\n")
    res = _bump(repo, new, patches_only=True)
    assert res.step("source").status == "failed" and "src/llama.cpp" in res.step("source").summary


def test_an_altered_file_is_refused_against_the_commit(tmp_path):
    tree = make_tree(tmp_path / "t", FILES)
    git(tree, "init", "-q")
    git(tree, "add", "-A")
    git(tree, "commit", "-qm", "c")
    commit = git(tree, "rev-parse", "HEAD").strip()
    copy = tmp_path / "copy"
    copy.mkdir()
    newsource._copy_covered(tree, copy)
    assert "all 4 covered files" in newsource._check_against_commit(copy, tree / ".git", commit)
    (copy / "src" / "llama.cpp").write_text("int tampered;\n")
    with pytest.raises(UpstreamError, match=r"src/llama.cpp: differs from llama.cpp .* refused"):
        newsource._check_against_commit(copy, tree / ".git", commit)
    (copy / "src" / "llama.cpp").unlink()
    with pytest.raises(UpstreamError, match=r"src/llama.cpp: in llama.cpp .* missing from the source"):
        newsource._check_against_commit(copy, tree / ".git", commit)


def test_the_sdist_records_of_its_commit_must_agree(tmp_path):
    meta = tmp_path / "meta"
    head = meta / ".git" / "modules" / "vendor" / "llama.cpp" / "HEAD"
    head.parent.mkdir(parents=True)
    head.write_text(NEW_COMMIT + "\n")
    line = "- feat: update llama.cpp to ggml-org/llama.cpp@"
    text = f"## [0.3.9]\n\n{line}{NEW_COMMIT[:9]}\n\n## [0.3.8]\n\n{line}{FAKE_COMMIT[:9]}\n"
    (meta / "CHANGELOG.md").write_text(text)
    commit, how = newsource._vendored_commit(meta, "0.3.9")
    assert commit == NEW_COMMIT and "CHANGELOG 0.3.9" in how
    with pytest.raises(UpstreamError, match="CHANGELOG says 0.3.8 updates llama.cpp to ababababa"):
        newsource._vendored_commit(meta, "0.3.8")


def test_parse_patch_splits_files_and_hunks(repo):
    text = (repo["root"] / "patches" / "llama.cpp" / "0002-Use-the-hook.patch").read_text()
    [sec] = restack.parse_patch(text)
    assert sec.path == "src/llama.cpp" and len(sec.hunks) == 1
    assert sec.hunks[0][0].startswith("@@ -6,7 +6,7 @@")
    assert not any(line.startswith("-- ") for line in sec.hunks[0])  # the signature is not part of it


STANDIN_CMAKE = """cmake_minimum_required(VERSION 3.16)
project(standin CXX)
add_library(dgr_engine SHARED engine.cpp)
target_include_directories(dgr_engine PRIVATE ${DGR_LLAMA_SRC}/include)
set_target_properties(dgr_engine PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR})
set(DGR_WORKER_ENABLED ON CACHE INTERNAL "")
add_executable(dgr-worker worker.cpp)
file(READ ${CMAKE_CURRENT_SOURCE_DIR}/../toolchains/llama.cpp.pin.json PIN)
string(JSON COMMIT GET "${PIN}" commit)
target_compile_definitions(dgr-worker PRIVATE PIN_COMMIT="${COMMIT}")
set_target_properties(dgr-worker PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR})
"""


@pytest.mark.skipif(not (shutil.which("cmake") and shutil.which("ninja")), reason="needs cmake and ninja")
def test_the_build_is_the_scratch_ones_over_the_new_tree(repo):
    worker = repo["root"] / "worker"
    worker.mkdir()
    (worker / "CMakeLists.txt").write_text(STANDIN_CMAKE)
    (worker / "engine.cpp").write_text('#include "llama.h"\nextern "C" int v(void) { return TINY_LLAMA_VALUE; }\n')
    (worker / "worker.cpp").write_text('#include <cstdio>\nint main() { std::puts(PIN_COMMIT); }\n')
    from dgr.toolchain.upstream.bumpchecks import check_build

    new = _new_tree(repo, "new", {"ggml/src/ggml.c": "int ggml_tiny(void) { return 2; }\n"})
    res = _bump(repo, new, commit=NEW_COMMIT, checks=[("build", check_build)])
    assert res.step("build").status == "passed", res.step("build").summary
    bdir = res.scratch / "ws" / "build" / "cpu"
    # dgr-worker embeds the scratch pin (../toolchains of the worker copy): it advertises the new commit
    assert subprocess.run([str(bdir / "dgr-worker")], capture_output=True, text=True).stdout.strip() == NEW_COMMIT
    assert (bdir / "libdgr_engine.so").is_file() and not (repo["ws"] / "build").exists()


# --- the real pin and its patch stack --------------------------------------------------------------------


def test_real_pin_a_changed_upstream_line_names_the_patch_hunk_and_file(llama_src, tmp_path):
    """Seconds once the workspace holds the pinned tree (the `llama_src` fixture fetches it once)."""
    pin = upstream.load_pin()
    before = pin.path.read_bytes()
    pristine = upstream.layout(pin).pristine
    new = tmp_path / "llama.cpp"
    shutil.copytree(pristine, new, symlinks=True)
    # upstream rewords the line right after the member 0001 adds to llama_hparams (its second hunk of
    # src/llama-hparams.h): the change touches the hunk's own lines, so a three-way merge conflicts too
    h = new / "src" / "llama-hparams.h"
    h.write_text(h.read_text().replace("    // granite-switch: index of the single-head",
                                       "    // granite-switch: the index of the single-head"))
    res = bump.bump(str(new), bump.Options(commit=NEW_COMMIT, write=True, scratch=tmp_path / "scratch"), pin=pin)
    failed = [p for p in res.patches if p.how == "failed"]
    assert [p.name for p in failed] == ["0001-dgr-a-model-knows-the-layer-range-it-owns.patch"]
    [f] = failed[0].failures
    assert (f.file, f.hunk, f.hunks) == ("src/llama-hparams.h", 2, 2) and f.header.startswith("@@ -66,6 +68,9 @@")
    assert "`// granite-switch: index of the single-head" in f.why
    assert res.step("build").status == "not run" and res.refusal
    assert pin.path.read_bytes() == before


@pytest.mark.slow
def test_real_pin_a_no_op_bump_from_its_own_sdist(tmp_path):
    pin = upstream.load_pin()
    sdist = next(s for s in pin.sources if s.kind == "pypi-sdist")
    opts = bump.Options(patches_only=True, scratch=tmp_path / "s")
    res = bump.bump(f"{sdist.package}=={sdist.version}", opts, pin=pin)
    assert res.step("source").status == "passed", res.step("source").summary
    assert res.new.commit == pin.commit and res.new.tree_hash == pin.tree_hash
    assert any("own git tree" in c for c in res.step("source").lines)
    assert res.step("patches").status == "passed" and {p.how for p in res.patches} == {"clean"}
