"""Fetching the pinned upstream: hashes checked, wrong archives refused, sources tried in order."""

from __future__ import annotations

import json

import pytest

from dgr.core.errors import UpstreamError
from dgr.core.hashing import file_sha256
from dgr.toolchain import treehash, upstream

from support.upstream import (BUILD_FILES, RangeHandler, http_dir, make_tarball, make_tree,  # noqa: F401  (fixtures)
                              tiny, write_pin)


def test_fetch_extracts_only_the_verified_files(tiny):
    pin = upstream.load_pin(tiny["pin"])
    src = upstream.fetch(pin, tiny["ws"])
    assert src == tiny["ws"] / "upstream" / f"src-{pin.commit}"
    files = sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.is_file())
    assert files == BUILD_FILES
    assert (src / "tools" / "run.sh").stat().st_mode & 0o111
    assert upstream.verify(pin, tiny["ws"]) == pin.tree_hash
    meta = json.loads((tiny["ws"] / "upstream" / f"src-{pin.commit}.json").read_text())
    assert meta["source"] == f"archive {tiny['source']['url']}" and meta["tree_hash"] == pin.tree_hash
    # Present: a second fetch does nothing (no request reaches the server).
    RangeHandler.seen.clear()
    assert upstream.fetch(pin, tiny["ws"]) == src
    assert RangeHandler.seen == []


def test_tampered_archive_is_refused_with_a_message(tiny):
    # The served archive is rebuilt with one changed byte in one file: its sha256 no longer matches.
    (tiny["tree"] / "src" / "llama.cpp").write_text("int tiny_llama(void) { return 666; }\n")
    make_tarball(tiny["tree"], tiny["prefix"], tiny["tarball"])
    pin = upstream.load_pin(tiny["pin"])
    with pytest.raises(UpstreamError) as err:
        upstream.fetch(pin, tiny["ws"])
    msg = str(err.value)
    assert "sha256 mismatch" in msg and tiny["source"]["sha256"] in msg
    assert tiny["source"]["url"] in msg
    assert not (tiny["ws"] / "upstream" / f"src-{pin.commit}").exists()
    assert not list((tiny["ws"] / "cache" / "downloads").iterdir())  # nothing kept, not even a part file


def test_archive_with_the_right_sha_but_a_different_tree_is_refused(tiny):
    # A pin whose archive hash is right but whose tree hash is of another tree.
    other = make_tree(tiny["tree"].parent / "other")
    (other / "src" / "llama.cpp").write_text("different\n")
    write_pin(tiny["repo"], [tiny["source"]], treehash.tree_hash(other))
    pin = upstream.load_pin(tiny["pin"])
    with pytest.raises(UpstreamError, match="tree hash .* does not match the pin's"):
        upstream.fetch(pin, tiny["ws"])
    assert not (tiny["ws"] / "upstream" / f"src-{pin.commit}").exists()


def test_first_source_that_works_is_used(tiny):
    missing = {**tiny["source"], "url": f"{tiny['base']}/missing.tar.gz"}
    write_pin(tiny["repo"], [missing, tiny["source"]], treehash.tree_hash(tiny["tree"]))
    pin = upstream.load_pin(tiny["pin"])
    upstream.fetch(pin, tiny["ws"])
    assert upstream.status(pin, tiny["ws"])["source"] == f"archive {tiny['source']['url']}"
    assert [p for p, _ in RangeHandler.seen] == ["/missing.tar.gz", "/tiny.tar.gz"]


def test_no_source_works_lists_every_failure(tiny):
    bad = {**tiny["source"], "url": f"{tiny['base']}/missing.tar.gz"}
    write_pin(tiny["repo"], [bad], treehash.tree_hash(tiny["tree"]))
    with pytest.raises(UpstreamError, match=r"could not fetch llama.cpp .* from any source(.|\n)*404"):
        upstream.fetch(upstream.load_pin(tiny["pin"]), tiny["ws"])


def test_interrupted_download_resumes(tiny):
    pin = upstream.load_pin(tiny["pin"])
    downloads = tiny["ws"] / "cache" / "downloads"
    downloads.mkdir(parents=True)
    data = tiny["tarball"].read_bytes()
    half = len(data) // 2
    (downloads / f"{pin.commit}.tar.gz.part").write_bytes(data[:half])
    upstream.fetch(pin, tiny["ws"])
    assert RangeHandler.seen == [("/tiny.tar.gz", f"bytes={half}-")]
    assert file_sha256(downloads / f"{pin.commit}.tar.gz") == tiny["source"]["sha256"]


def test_verify_names_the_changed_file(tiny):
    pin = upstream.load_pin(tiny["pin"])
    src = upstream.fetch(pin, tiny["ws"])
    (src / "include" / "llama.h").write_text("#pragma once\n#define TINY_LLAMA_VALUE 0\n")
    with pytest.raises(UpstreamError, match=r"first difference: include/llama.h: content changed"):
        upstream.verify(pin, tiny["ws"])
    st = upstream.status(pin, tiny["ws"])
    assert st["fetched"] and not st["verified"] and "include/llama.h" in st["verify_error"]


def test_pin_errors_name_the_file_and_field(tmp_path):
    pin = write_pin(tmp_path, [{"kind": "archive", "url": "x", "sha256": "00", "strip_prefix": "p"}], None)
    with pytest.raises(UpstreamError, match=r"llama.cpp.pin.json: field sources\[0\].sha256"):
        upstream.load_pin(pin)
    pin.write_text("{not json")
    with pytest.raises(UpstreamError, match="not valid JSON"):
        upstream.load_pin(pin)
    write_pin(tmp_path, [{"kind": "archive", "url": "x", "sha256": "0" * 64, "strip_prefix": "p"}], None)
    with pytest.raises(UpstreamError, match="tree_hash is null.*treehash.py"):
        upstream.fetch(upstream.load_pin(pin), tmp_path / "ws")


def test_an_archive_member_escaping_the_tree_is_refused(tiny):
    import io
    import tarfile

    with tarfile.open(tiny["tarball"], "w:gz") as tar:
        data = b"escaped\n"
        info = tarfile.TarInfo(f"{tiny['prefix']}/src/../../evil.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    write_pin(tiny["repo"], [{**tiny["source"], "sha256": file_sha256(tiny["tarball"])}],
              treehash.tree_hash(tiny["tree"]))
    with pytest.raises(UpstreamError, match=r"member .*evil.txt points outside"):
        upstream.fetch(upstream.load_pin(tiny["pin"]), tiny["ws"])
    assert not (tiny["ws"] / "upstream" / "evil.txt").exists()


def test_a_pristine_tree_fetched_for_another_tree_hash_is_not_reused(tiny):
    upstream.fetch(upstream.load_pin(tiny["pin"]), tiny["ws"])
    other = make_tree(tiny["tree"].parent / "other")
    (other / "src" / "new.cpp").write_text("int n;\n")
    write_pin(tiny["repo"], [tiny["source"]], treehash.tree_hash(other))  # same commit, re-pinned tree
    with pytest.raises(UpstreamError, match="tree hash .* does not match the pin's"):
        upstream.fetch(upstream.load_pin(tiny["pin"]), tiny["ws"])


def test_a_different_tree_is_named_by_the_pinned_listing(tiny):
    # The pin keeps the listing of its tree (blake3 of the listing = tree_hash): a source whose
    # archive hash is right but whose tree differs is refused naming the file.
    listing = tiny["repo"] / "toolchains" / "tree.txt"
    listing.write_text(treehash.listing_text(treehash.listing(tiny["tree"])))
    (tiny["tree"] / "ggml" / "src" / "ggml.c").write_text("int ggml_tiny(void) { return 2; }\n")
    make_tarball(tiny["tree"], tiny["prefix"], tiny["tarball"])
    raw = json.loads(tiny["pin"].read_text())
    raw["sources"][0]["sha256"] = file_sha256(tiny["tarball"])
    raw["tree_listing"] = "toolchains/tree.txt"
    tiny["pin"].write_text(json.dumps(raw))
    with pytest.raises(UpstreamError, match=r"first difference: ggml/src/ggml.c: content changed"):
        upstream.fetch(upstream.load_pin(tiny["pin"]), tiny["ws"])
