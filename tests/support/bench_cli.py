"""Run a `dgr bench` subcommand in-process through its real argument parser, with `--json`, and read the report."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dgr.cli.commands import bench


def run_bench_json(tmp_path: Path, subcommand: str, *argv: str) -> tuple[int, dict]:
    """(exit code, the JSON report) of `dgr bench SUBCOMMAND --json FILE ARGV...`."""
    p = argparse.ArgumentParser(prog="dgr")
    bench.register(p.add_subparsers())
    out = tmp_path / f"{subcommand}.json"
    args = p.parse_args(["bench", subcommand, "--json", str(out), *argv])
    rc = args.func(args)
    return rc, json.loads(out.read_text())
