"""The repository's folders, from wherever a test sits under tests/ (tests/<area>/test_*.py, tests/support/)."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
