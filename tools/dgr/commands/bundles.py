"""`dgr` subcommands of the bundles area."""


def register(sub) -> None:
    """Add this area's subcommands to the `dgr` parser."""
