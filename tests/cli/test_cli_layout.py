"""Each `dgr` command lives in a module named after it, so the tree answers "where is `dgr X`?" by its
file names: `dgr build-engine` is registered and handled in tools/dgr/cli/commands/build_engine.py,
`dgr release` in release.py ('-' in a command's name is '_' in its module's).

The parser `dgr` itself builds (dgr.cli.main.build_parser) is walked: every subparser is mapped to the
module whose code called add_parser for it, and every handler (a parser's `func` default) to the module
that defines it. A command's subcommands count as its own: they are registered in its module too.
Code that several commands share (the route flags of `dgr generate` and `dgr serve`) lives outside
dgr/cli/commands/, so that folder holds commands only.
"""

from __future__ import annotations

import argparse
import pkgutil
import sys

import pytest

import dgr.cli.commands
from dgr.cli.main import build_parser

PACKAGE = "dgr.cli.commands"


def module_for(command: str) -> str:
    return f"{PACKAGE}.{command.replace('-', '_')}"


@pytest.fixture(scope="module")
def cli():
    """(the top-level commands: name -> parser, registrar: id(parser) -> the module that added it)."""
    registrar: dict[int, str] = {}
    real = argparse._SubParsersAction.add_parser

    def add_parser(self, name, **kwargs):
        parser = real(self, name, **kwargs)
        registrar[id(parser)] = sys._getframe(1).f_globals["__name__"]
        return parser

    argparse._SubParsersAction.add_parser = add_parser
    try:
        root = build_parser()
    finally:
        argparse._SubParsersAction.add_parser = real
    (top,) = [a for a in root._actions if isinstance(a, argparse._SubParsersAction)]
    yield dict(top.choices), registrar, root        # root kept alive: the ids stay its parsers'


def _tree(parser: argparse.ArgumentParser, path: list[str]):
    """(path, parser) for parser and every subcommand under it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _tree(sub, [*path, name])


def test_there_are_commands_to_check(cli):
    commands, _, _ = cli
    assert len(commands) > 20 and "build-engine" in commands and "release" in commands


def test_each_command_is_registered_by_the_module_named_after_it(cli):
    commands, registrar, _ = cli
    wrong = [f"`dgr {' '.join(path)}` by {registrar.get(id(p), '?')} (want {module_for(name)})"
             for name, top in commands.items() for path, p in _tree(top, [name])
             if registrar.get(id(p)) != module_for(name)]
    assert not wrong, "registered outside the module named after the command: " + "; ".join(wrong)


def test_each_commands_handlers_live_in_the_module_named_after_it(cli):
    commands, _, _ = cli
    wrong, handled = [], 0
    for name, top in commands.items():
        for path, p in _tree(top, [name]):
            func = p._defaults.get("func")
            if func is None:
                continue
            handled += 1
            if getattr(func, "__module__", None) != module_for(name):
                wrong.append(f"`dgr {' '.join(path)}`: {getattr(func, '__module__', '?')}."
                             f"{getattr(func, '__qualname__', func)} (want {module_for(name)})")
    assert handled >= len(commands)
    assert not wrong, "handled outside the module named after the command: " + "; ".join(wrong)


def test_every_module_in_commands_is_a_command(cli):
    """No module in dgr/cli/commands/ without the command it is named after (a module that held a
    command which moved, or helpers that belong outside the folder)."""
    commands, _, _ = cli
    modules = {f"{PACKAGE}.{m.name}" for m in pkgutil.iter_modules(dgr.cli.commands.__path__)}
    assert modules
    orphans = sorted(modules - {module_for(name) for name in commands})
    assert not orphans, f"modules in {PACKAGE} that no `dgr` command is named after: {orphans}"
