"""Synthetic specs of the dense_b family group (see dgr.families)."""

from __future__ import annotations

from dgr.synthspec import ArchSpec

SPECS: dict[str, ArchSpec] = {}
