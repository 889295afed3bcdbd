"""The `dgr` command (`main`) and its subcommands (`commands`, one module per command, named after it;
`shared`, what several of them parse the same way): the top layer."""
