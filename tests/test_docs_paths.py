"""Docs follow the tree: every repository path that README.md, docs/*.md and docs/TEAM.md name in
backticks exists (issue 25: a moved file whose docs still send a reader to the old place fails here).

A path counts when it starts with one of the repository's top-level folders. `{a,b}` lists expand,
`*` and `**` globs must match something, and `<placeholder>` / `NNNN` / `...` parts stand for names
and are matched as globs. A `:line` or `::test` suffix is dropped. A path on a line that says it was
deleted or retired (or next to such a line) is history, not a claim that it exists."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from support.docpaths import expand

REPO = Path(__file__).resolve().parents[1]
TOP = ("tools/", "worker/", "tests/", "scripts/", "docs/", "proto/", "toolchains/", "recipes/",
       "certification/", "deploy/", "nix/", "patches/", ".ci/")
TICKED = re.compile(r"`([^`\s]+)`")


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def as_glob(path: str) -> str:
    path = re.sub(r"<[^>]+>", "*", path)
    path = path.replace("...", "*").replace("NNNN", "*")
    return path


HISTORY = re.compile(r"\b(deleted|retired)\b", re.I)


HISTORY = re.compile(r"\b(deleted|retired)\b", re.I)


def named_paths(text: str) -> list[str]:
    out = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if any(HISTORY.search(lines[j]) for j in range(max(0, i - 1), min(len(lines), i + 2))):
            continue
        for raw in TICKED.findall(line):
            p = raw.split("::")[0]
            p = re.sub(r":\d+(-\d+)?$", "", p)
            if not p.endswith("..."):
                p = p.rstrip(".,;:)")
            if p.startswith(TOP):
                out.append(p)
    return out


def missing_in(doc: Path) -> list[str]:
    missing = []
    for named in named_paths(doc.read_text()):
        for p in expand(named):
            g = as_glob(p)
            if any(ch in g for ch in "*?["):
                if not any(REPO.glob(g.rstrip("/"))):
                    missing.append(named)
            elif not (REPO / p).exists():
                missing.append(named)
    return sorted(set(missing))


@pytest.mark.parametrize("doc", doc_files(), ids=lambda d: str(d.relative_to(REPO)))
def test_every_named_path_exists(doc: Path) -> None:
    missing = missing_in(doc)
    assert not missing, (f"{doc.relative_to(REPO)} names paths that are not in the tree (moved or "
                         f"deleted?): {missing}")


def test_the_check_catches_a_moved_file(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("The client is `tools/dgr/runtime/wire/client.py`; the planner `tools/dgr/{planner,recipe}.py`;"
                   " globbed `patches/llama.cpp/NNNN-*.patch`.\n")
    assert missing_in(doc) == ["tools/dgr/{planner,recipe}.py"]
    doc.write_text("`tools/dgr/nothing-here.py` and `worker/nothing/<stage>.cpp` and `docs/nope/`\n"
                   "\n`tools/dgr/gone.py` was deleted in issue 21.\n")
    assert missing_in(doc) == ["docs/nope/", "tools/dgr/nothing-here.py", "worker/nothing/<stage>.cpp"]
