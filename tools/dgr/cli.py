"""The `dgr` command line: thin. Parses, calls the library, prints; typed errors become exit codes.

Each area registers its own subcommands from `dgr.commands.<area>` (one file per area, so areas grow
independently). A command handler takes the parsed args and returns an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from dgr.errors import DgrError
from dgr.log import setup as setup_logging

# Areas, in the order their commands are listed in `dgr --help`.
AREAS = ("bundles", "upstream", "engine", "worker", "wire", "serve", "certs", "certify", "bench", "build", "deploy")


class _Version(argparse.Action):
    """`dgr --version`: computed only when asked (it reads the release's metadata or the pin)."""

    def __call__(self, parser, namespace, values, option_string=None):
        from dgr.buildinfo import build_info

        print(build_info().describe())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dgr", description="Distributed GGUF runtime")
    parser.add_argument("--version", action=_Version, nargs=0,
                        help="the version, the llama.cpp commit and the patch series this dgr carries")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for area in AREAS:
        importlib.import_module(f"dgr.commands.{area}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except DgrError as err:
        print(f"dgr: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("dgr: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
