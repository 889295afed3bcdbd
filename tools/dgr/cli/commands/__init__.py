"""The `dgr` commands, one module per top-level command, named after it (`dgr build-engine`: build_engine.py) and
holding its subcommands, each with a `register(sub)` that dgr.cli.main calls in `dgr --help` order."""
