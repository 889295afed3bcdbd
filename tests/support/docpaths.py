"""Paths that docs name: brace lists expanded as a shell would (`a/{b,c}.py` -> a/b.py, a/c.py)."""
from __future__ import annotations

import itertools
import re


def expand(path: str) -> list[str]:
    """`a/{b,c}.py` -> ["a/b.py", "a/c.py"] (every brace list)."""
    parts = re.split(r"(\{[^{}]*\})", path)
    choices = [p[1:-1].split(",") if p.startswith("{") and p.endswith("}") else [p] for p in parts]
    return ["".join(c) for c in itertools.product(*choices)]
