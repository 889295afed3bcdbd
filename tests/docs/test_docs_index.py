"""docs/README.md indexes every doc: each docs/*.md has a line there, a link to it and the question it
answers, and every file it links exists. README.md's "Docs" section points at that index (and may name a few
docs to start with, each of which exists). A new doc that nobody indexes would be found only by accident; an
index line whose doc was renamed or deleted sends a reader nowhere."""
from __future__ import annotations

import re
from pathlib import Path

from support.paths import REPO

DOCS = REPO / "docs"
INDEX = DOCS / "README.md"
ENTRY = re.compile(r"^- (?:`((?:docs/)?[^`]+\.md)`|\[[^\]]*\]\(((?:docs/)?[^)]+\.md)\))\s+[—–-]+\s+\S")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s#]+)(?:#[^)]*)?\)")


def docs_section(readme: str) -> str:
    m = re.search(r"^## Docs\n(.*?)(?=^## |\Z)", readme, re.M | re.S)
    assert m, "README.md has no \"## Docs\" section"
    return m.group(1)


def indexed(readme: str) -> list[str]:
    """The file each entry line (`- [name](X.md) — what it answers`, or `X.md` in backticks) of README.md's
    Docs section names, as written."""
    return [a or b for line in docs_section(readme).splitlines() for a, b in ENTRY.findall(line)]


def index_entries(text: str) -> list[str]:
    """The docs (paths from the repository root) that docs/README.md's entry lines link, in order."""
    out = []
    for line in text.splitlines():
        for a, b in ENTRY.findall(line):
            out.append((INDEX.parent / (a or b)).resolve().relative_to(REPO).as_posix())
    return out


def local_links(text: str, base: Path) -> list[str]:
    """Every relative link target in `text` (no URL, no bare anchor), resolved from `base`."""
    out = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue
        out.append(str((base / target).resolve()))
    return out


def unindexed(docs: list[str], entries: list[str]) -> list[str]:
    return [d for d in docs if d not in entries]


def all_docs() -> list[str]:
    return sorted(p.relative_to(REPO).as_posix() for p in DOCS.glob("*.md") if p != INDEX)


def test_docs_readme_indexes_every_doc() -> None:
    entries = index_entries(INDEX.read_text())
    docs = all_docs()
    assert docs
    missing = unindexed(docs, entries)
    assert not missing, f"docs/README.md has no line ([X.md](X.md) — the question it answers) for {missing}"
    twice = sorted({d for d in entries if entries.count(d) > 1})
    assert not twice, f"docs/README.md lists these twice: {twice}"


def test_docs_readme_links_only_files_that_exist() -> None:
    gone = [t for t in local_links(INDEX.read_text(), INDEX.parent) if not Path(t).exists()]
    assert not gone, f"docs/README.md links files that do not exist: {gone}"


def test_readme_points_at_the_index() -> None:
    listed = indexed((REPO / "README.md").read_text())
    assert "docs/README.md" in listed, "README.md's Docs section has no line for docs/README.md, the index"
    gone = [d for d in listed if not (REPO / d).exists()]
    assert not gone, f"README.md's Docs section lists docs that do not exist: {gone}"
    twice = sorted({d for d in listed if listed.count(d) > 1})
    assert not twice, f"README.md's Docs section lists these twice: {twice}"


def test_the_checks_read_entries_and_links_and_nothing_else() -> None:
    readme = ("## Docs\n\n- `docs/a.md` — what a holds\n- [b](docs/b.md) - what b holds\n- `docs/c.md`\n"
              "see `docs/d.md`\n- `CHANGELOG.md` — what changed\n\n## Layout\n\n- `docs/e.md` — not the index\n")
    assert indexed(readme) == ["docs/a.md", "docs/b.md", "CHANGELOG.md"]
    index = ("## Start\n\n- [glossary.md](glossary.md) — What do the words mean?\n- [gone.md](gone.md)\n"
             "- [`CHANGELOG.md`](../CHANGELOG.md) — What changed?\nSee [wire](wire.md#the-ring) and "
             "[x](https://example.org/x.md).\n")
    assert index_entries(index) == ["docs/glossary.md", "CHANGELOG.md"]
    assert unindexed(["docs/glossary.md", "docs/wire.md"], index_entries(index)) == ["docs/wire.md"]
    links = [Path(t).relative_to(REPO).as_posix() for t in local_links(index, INDEX.parent)]
    assert links == ["docs/glossary.md", "docs/gone.md", "CHANGELOG.md", "docs/wire.md"]
