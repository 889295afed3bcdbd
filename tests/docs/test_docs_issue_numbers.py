"""The docs and CHANGELOG.md cite no issue numbers: the tracker they would point at is not in the
repository, so "issue 21" tells a reader of a clone nothing. A doc names the capability instead ("the
per-hop goal", "the prefix cache"), or the doc section that explains it. Code comments are not checked here."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from support.paths import REPO

CITATION = re.compile(r"\bissues?\s+#?\d+", re.I)


def doc_files() -> list[Path]:
    return [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").rglob("*.md"))]


def citations(text: str) -> list[str]:
    return [f"line {n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1) if CITATION.search(line)]


@pytest.mark.parametrize("doc", doc_files(), ids=lambda d: str(d.relative_to(REPO)))
def test_no_doc_cites_an_issue_number(doc: Path) -> None:
    found = citations(doc.read_text())
    assert not found, (f"{doc.relative_to(REPO)} cites issue numbers of a tracker that is not in the "
                       f"repository; name what it refers to, or the doc section that explains it: {found}")


def test_the_check_catches_a_citation() -> None:
    assert citations("Goal (Issue 21): 0.1 ms.\nafter issues 13, 14\nsee issue #35\n")
    assert not citations("`dgr certs issue DIR NAME`\nissued by `dgr certs issue` for 2 names\n")
