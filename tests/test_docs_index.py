"""README.md's "Docs" section indexes every doc: each docs/*.md has a line there, `docs/X.md` (or a link to
it) and a description of what it holds. A new doc that nobody indexes would be found only by accident."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENTRY = re.compile(r"^- (?:`(docs/[^`]+\.md)`|\[[^\]]*\]\((docs/[^)]+\.md)\))\s+[—–-]+\s+\S")


def docs_section(readme: str) -> str:
    m = re.search(r"^## Docs\n(.*?)(?=^## |\Z)", readme, re.M | re.S)
    assert m, "README.md has no \"## Docs\" section"
    return m.group(1)


def indexed(readme: str) -> list[str]:
    return [a or b for line in docs_section(readme).splitlines() for a, b in ENTRY.findall(line)]


def test_readme_indexes_every_doc() -> None:
    listed = indexed((REPO / "README.md").read_text())
    docs = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md"))
    assert docs
    missing = [d for d in docs if d not in listed]
    assert not missing, f"README.md's Docs section has no line (`docs/X.md` — what it holds) for {missing}"
    gone = [d for d in listed if not (REPO / d).exists()]
    assert not gone, f"README.md's Docs section lists docs that do not exist: {gone}"
    twice = sorted({d for d in listed if listed.count(d) > 1})
    assert not twice, f"README.md's Docs section lists these twice: {twice}"


def test_the_check_reads_entries_and_nothing_else() -> None:
    readme = ("## Docs\n\n- `docs/a.md` — what a holds\n- [b](docs/b.md) - what b holds\n- `docs/c.md`\n"
              "see `docs/d.md`\n\n## Layout\n\n- `docs/e.md` — not the index\n")
    assert indexed(readme) == ["docs/a.md", "docs/b.md"]
