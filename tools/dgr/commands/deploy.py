"""`dgr` subcommands of the deploy area: deploy plan/render, up, down, status (being built: issue 13)."""

from __future__ import annotations


def register(sub) -> None:
    """Add this area's subcommands to the `dgr` parser."""
