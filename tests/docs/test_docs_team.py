"""docs/TEAM.md's table of who owns what tells the truth about the tree: every module of the dgr
package is named there (itself or its folder), and every path it names exists."""

from __future__ import annotations

import re

from support.docpaths import expand
from support.paths import REPO


def named_paths() -> list[str]:
    table = [line for line in (REPO / "docs" / "TEAM.md").read_text().splitlines() if line.startswith("| ")]
    out: list[str] = []
    for line in table:
        for cell in line.split("|")[2:]:
            for tick in re.findall(r"`([^`]+)`", cell):
                path = tick.split(" ")[0]
                if "/" in path or path.startswith("."):
                    out += expand(path)
    return out


def test_every_module_of_the_package_has_an_owner():
    named = named_paths()
    modules = [p.relative_to(REPO).as_posix() for p in (REPO / "tools" / "dgr").rglob("*.py")
               if "gen" not in p.parts and p.name != "__init__.py" and p.name != "__main__.py"]
    assert modules
    orphans = [m for m in modules if not any(m == n or (n.endswith("/") and m.startswith(n)) for n in named)]
    assert not orphans, f"docs/TEAM.md names no owner for {orphans}"


def test_every_path_the_table_names_exists():
    missing = [n for n in named_paths() if "*" not in n and not (REPO / n).exists()]
    assert not missing, f"docs/TEAM.md names paths that do not exist: {missing}"
