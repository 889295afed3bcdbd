"""`dgr` subcommands of the engine area."""


def register(sub) -> None:
    """Add this area's subcommands to the `dgr` parser."""
