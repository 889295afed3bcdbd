"""`dgr` subcommands of the wire area."""


def register(sub) -> None:
    """Add this area's subcommands to the `dgr` parser."""
