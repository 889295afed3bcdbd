"""`dgr bench`: every benchmark, one module per measurement, each run side by side in one run on one machine.

What `dgr bench ...` runs (tools/dgr/cli/commands/bench.py) and where:

- `pipeline`: the bare `dgr bench`, the whole model against the pipeline; `pipeline_report` draws its report
  (the table and `--plot`); `loopback_floor` is what one bare message costs between two processes;
- `wan` (`--wan-rtt-ms`): the route through emulated WAN links, which `wan_link` makes (a delaying forwarder
  per hop; the conversation, MTP and peers benchmarks use it too);
- `dtypes` (`--dtypes`): what each wire dtype costs and loses per architecture;
- `speculate_ngram` (`--speculate ngram`) and `speculate_mtp` (`--speculate mtp`): what drafts gain;
- `soak` (`dgr bench soak`), with `hostile`'s attackers for `--hostile N`;
- `tls_cost` (`tls`), `frame_cost` (`frames`), `conversation`, `numerics`, `peers` and `scale` (the cost curve
  of 1, 2, 4, 8 stages): the subcommands of those names.

Benchmarks measure; certification (dgr.app.certify) judges. The gate may run a benchmark's measurement
(`dgr gate beta`'s speculation rows run speculate_mtp's), never the other way round: nothing here imports
dgr.app.certify (.importlinter, contract "bench-below-certify"). What both need lives below both.
"""
