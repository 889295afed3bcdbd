"""`dgr` subcommands of the build area."""


def register(sub) -> None:
    """Add this area's subcommands to the `dgr` parser."""
