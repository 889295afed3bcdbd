"""Shared pytest fixtures. Each area adds its fixtures here with small edits (never rewrite the file)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO
