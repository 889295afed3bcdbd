"""docs/glossary.md defines the project's own words, each pointing at where it is explained in depth: every
word a newcomer meets has an entry, every entry points somewhere, and every section it points at (`docs/X.md`,
"Heading") is a heading of that doc. A renamed section or a dropped word fails here."""
from __future__ import annotations

import re
from pathlib import Path

from support.paths import REPO

GLOSSARY = REPO / "docs" / "glossary.md"
TERMS = ["stage", "route", "hop", "ring", "seam", "boundary", "origin", "session", "epoch", "lane", "member",
         "bundle", "recipe", "manifest", "numerics", "prefix cache", "drafts", "speculation", "MTP", "gateway",
         "worker", "engine", "fake engine", "certificate", "TLS certificate", "CA", "gate"]
POINTER = re.compile(r'`(docs/[\w.-]+\.md)`,\s+"([^"]+)"')


def entries(text: str) -> dict[str, str]:
    """{bold title: its paragraph} for every paragraph that opens with a bold title."""
    out = {}
    for para in re.split(r"\n\s*\n", text):
        m = re.match(r"\*\*([^*]+)\*\*", para)
        if m:
            out[m.group(1)] = para
    return out


def headings(doc: Path) -> set[str]:
    out, fenced = set(), False
    for line in doc.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            out.add(" ".join(line.lstrip("#").split()))
    return out


def missing_terms(text: str) -> list[str]:
    titles = list(entries(text))
    return [t for t in TERMS if not any(re.search(rf"\b{re.escape(t)}\b", title) for title in titles)]


def broken_pointers(text: str) -> list[str]:
    bad = []
    for doc, heading in POINTER.findall(text):
        heading = " ".join(heading.split())
        if not (REPO / doc).exists():
            bad.append(f"{doc} (no such doc)")
        elif heading not in headings(REPO / doc):
            bad.append(f'{doc}, "{heading}"')
    return bad


def test_every_word_has_an_entry() -> None:
    missing = missing_terms(GLOSSARY.read_text())
    assert not missing, f"docs/glossary.md has no entry for {missing}"


def test_every_entry_points_at_where_it_is_explained() -> None:
    bare = [title for title, para in entries(GLOSSARY.read_text()).items() if "`docs/" not in para]
    assert not bare, f"docs/glossary.md: these entries point nowhere (add See `docs/X.md`, \"Section\"): {bare}"


def test_every_section_the_glossary_points_at_exists() -> None:
    text = GLOSSARY.read_text()
    assert len(POINTER.findall(text)) >= len(TERMS) // 2
    bad = broken_pointers(text)
    assert not bad, f"docs/glossary.md points at sections that are not there (renamed?): {bad}"


def test_the_checks_catch_a_dropped_word_and_a_renamed_section() -> None:
    text = ('**stage**: a range. See `docs/wire.md`, "The ring:\nstage 0 is the origin".\n\n'
            '**ring**: the path. See `docs/wire.md`, "The Ring".\n')
    assert "epoch" in missing_terms(text) and "stage" not in missing_terms(text)
    assert broken_pointers(text) == ['docs/wire.md, "The Ring"']
