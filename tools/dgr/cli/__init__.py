"""The `dgr` command (`main`) and its subcommands (`commands`, one module per area): the top layer."""
