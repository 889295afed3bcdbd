"""The `dgr` subcommands, one module per area (registered by dgr.cli.main)."""
