"""The `dgr` command line: thin. Parses, calls the library, prints; typed errors become exit codes.

Each command is registered, and handled, by the module named after it: `dgr build-engine` by
`dgr.cli.commands.build_engine` (one file per command, '-' in its name '_' in the module's, so commands grow
independently and the tree says where each one is; tests/cli/test_cli_layout.py checks). What several commands
parse the same way is `dgr.cli.shared`'s. A command handler takes the parsed args and returns an exit code.

Output into a pipe that closes early (`dgr status FILE | head`) stops quietly with exit status 141, as
the Python docs recommend (https://docs.python.org/3/library/signal.html#note-on-sigpipe): Python
ignores SIGPIPE, so a write to a closed pipe raises BrokenPipeError instead of ending the process. 141
(128 + SIGPIPE) is what a shell reports for any other program killed by SIGPIPE (`cat f | head` under
`set -o pipefail`), so a script sees dgr's cut-short output the way it sees theirs; without pipefail the
shell reports `head`'s status.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from dgr.core.errors import DgrError, EngineError
from dgr.core.log import setup as setup_logging
from dgr.runtime.engine_abi import build_numerics, library_path

# The commands, in the order `dgr --help` lists them; each one's module is dgr.cli.commands.<command, '-' as '_'>.
COMMANDS = ("inspect", "synth", "recipe", "bundle", "upstream", "build-engine", "baseline", "parity", "worker",
            "generate", "demo", "wire", "serve", "certs", "certify", "gate", "bench", "release", "deploy", "up", "down",
            "status")


class _Version(argparse.Action):
    """`dgr --version`: computed only when asked (it reads the release's metadata or the pin)."""

    def __call__(self, parser, namespace, values, option_string=None):
        # lazy: dgr.toolchain.buildinfo costs 7 ms at start-up (python -X importtime, 2026-12-05)
        from dgr.toolchain.buildinfo import build_info

        print(build_info().describe())
        print(_numerics_line())
        parser.exit()


def _numerics_line() -> str:
    """What the engine library this dgr would load computes with (docs/numerics.md), or why it cannot say."""
    try:
        path = library_path()
        return f"numerics {build_numerics(path)} ({path})"
    except (EngineError, OSError, AttributeError) as err:
        return f"numerics unknown: {err}"


class _Parser(argparse.ArgumentParser):
    """argparse's parser, except that a closed output pipe is not swallowed: argparse ignores an OSError while
    it prints (help, usage), so a help text longer than stdout's buffer, cut off by `| head`, would exit 0
    having printed part of it. Here it reaches main(), which exits EXIT_CLOSED_PIPE. Subparsers inherit it."""

    def _print_message(self, message, file=None):
        if message:
            (file or sys.stderr).write(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dgr", description="Distributed GGUF runtime")
    parser.add_argument("--version", action=_Version, nargs=0,
                        help="the version, the llama.cpp commit and the patch series this dgr carries, and the numerics "
                        "of the engine library it would load")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        importlib.import_module(f"dgr.cli.commands.{command.replace('-', '_')}").register(sub)
    return parser


# 128 + SIGPIPE: the exit status of a command whose output pipe was closed (the module docstring says why)
EXIT_CLOSED_PIPE = 141


def _run(argv: list[str] | None) -> int:
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


def _silence_closed_streams() -> None:
    """Point stdout and stderr at /dev/null where their reader is gone: what is still buffered for them
    would fail again when Python flushes them at exit ("Exception ignored ... BrokenPipeError")."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, stream.fileno())
                os.close(devnull)
            except (OSError, ValueError, AttributeError):
                pass                                    # not a real file (a test's capture): nothing to flush


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            return _run(argv)
        finally:
            sys.stdout.flush()                          # a closed pipe shows here, not at interpreter exit
    except BrokenPipeError:
        _silence_closed_streams()
        return EXIT_CLOSED_PIPE


if __name__ == "__main__":
    sys.exit(main())
