"""`dgr` subcommands of the upstream area."""


def register(sub) -> None:
    """Add this area's subcommands to the `dgr` parser."""
