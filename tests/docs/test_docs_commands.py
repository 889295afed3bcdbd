"""A `dgr <command>` the docs name is a command `dgr` has: every `dgr X [Y]` in an inline code span or a
console/shell block of README.md, CHANGELOG.md and docs/*.md is a path through the CLI's parser
(`dgr.cli.main.build_parser`), subcommand by subcommand, as `dgr --help` lists them. A renamed or dropped
command whose doc still sends a reader to it fails here.

In README.md and docs/README.md (the pages a newcomer reads first) the `--flags` written right after a
command must be flags of that command too. Elsewhere flags are not checked: a doc may quote a flag of a
retired command in a measurement it records.

CHANGELOG.md records the past: a command on a line that says it was retired or removed is history, not a
claim that it exists."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from dgr.cli.main import build_parser

from support.paths import REPO

SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
# `dgr` as a command: not `dgr-worker`, `.dgr/`, `dgr.cli`, `dgr_worker_...` nor "dgr:" (a log line's prefix)
COMMAND = re.compile(r"(?<![\w./-])dgr((?:[ \t]+[^\s|;&]+)+)")
WORD = re.compile(r"^[a-z][a-z0-9-]*$")
HISTORY = re.compile(r"\b(retired|removed)\b", re.I)
FLAGS_CHECKED = ("README.md", "docs/README.md")


def doc_files() -> list[Path]:
    return [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(subs[0].choices) if subs else {}


def mentions(text: str) -> list[tuple[int, str]]:
    """(line number, the words after `dgr`) for every `dgr ...` in an inline code span or at the start of a
    line (after an optional `$ `) of a fenced block. A shell pipe or `&&` ends one command."""
    out: list[tuple[int, str]] = []
    fenced = set()
    for m in FENCE.finditer(text):
        first = text.count("\n", 0, m.start(1)) + 1
        for i, line in enumerate(m.group(1).splitlines()):
            fenced.add(first + i)
            line = line.strip().removeprefix("$ ")
            if line.startswith("dgr ") or line.startswith("dgr\t"):
                out.append((first + i, line[3:].split("#")[0]))
    for n, line in enumerate(text.splitlines(), 1):
        if n in fenced:
            continue
        for span in SPAN.findall(line):
            for m in COMMAND.finditer(span):
                out.append((n, m.group(1)))
    return out


def check(words: str, parser: argparse.ArgumentParser, flags: bool) -> str | None:
    """None when `words` (what follows `dgr`) walks the parser's subcommands (and, with `flags`, names only
    flags of the command it reached); otherwise what is wrong. The walk stops at the first positional
    argument of a command without subcommands, or at anything it cannot read (`...`, a placeholder)."""
    tokens = re.split(r"\s*(?:\|\||&&|\||;)\s*", words.strip())[0].split()
    path, at, i = [], parser, 0
    while i < len(tokens):
        tok, i = tokens[i], i + 1
        subs = _subparsers(at)
        word = tok.rstrip(".,:)")
        if tok.startswith("--"):
            flag = tok.split("=")[0].rstrip(".,:)")
            action = at._option_string_actions.get(flag)
            if action is None:
                if flags:
                    return f"dgr {' '.join(path)} has no flag {flag}".replace("dgr  ", "dgr ")
                break                       # unknown here, unchecked: where its value ends is unknown too
            if action.nargs != 0 and "=" not in tok:
                i += 1                      # its value
            continue
        if subs and WORD.match(word):
            if word not in subs:
                where = f"dgr {' '.join(path)}".rstrip()
                return f"{where} has no command {word!r} (it has: {', '.join(subs)})"
            path.append(word)
            at = subs[word]
            if tok != word:                 # `dgr up,` `dgr status:` end the command
                break
            continue
        break                               # a positional argument, a placeholder, `...`
    return None                             # `dgr 0.1.0 (checkout)`, `<dgr version>`: output, not a command


def problems(doc: Path, parser: argparse.ArgumentParser) -> list[str]:
    rel = doc.relative_to(REPO).as_posix()
    text = doc.read_text()
    lines = text.splitlines()
    out = []
    for n, words in mentions(text):
        if rel == "CHANGELOG.md" and HISTORY.search(lines[n - 1]):
            continue
        why = check(words, parser, rel in FLAGS_CHECKED)
        if why:
            out.append(f"{rel}:{n}: `dgr{words}`: {why}")
    return out


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    return build_parser()


@pytest.mark.parametrize("doc", doc_files(), ids=lambda d: str(d.relative_to(REPO)))
def test_every_dgr_command_a_doc_names_exists(doc: Path, parser: argparse.ArgumentParser) -> None:
    assert doc.exists(), f"{doc.relative_to(REPO)} is missing"
    bad = problems(doc, parser)
    assert not bad, "docs name dgr commands the CLI does not have (renamed? retired?):\n" + "\n".join(bad)


def test_the_index_and_the_changelog_name_commands() -> None:
    """The two files this check was written for do name commands, so an empty match is not a pass."""
    for name in ("docs/README.md", "CHANGELOG.md", "README.md"):
        assert mentions((REPO / name).read_text()), f"{name}: no `dgr ...` found: is the pattern still right?"


def test_the_check_catches_a_wrong_command_and_flag(parser: argparse.ArgumentParser) -> None:
    text = ("Run `dgr bench frames --rounds 5` and `dgr deploy plan deploy/x.toml`, `dgr up`, then `dgr status:`.\n"
            "`dgr-worker --probe`, `.dgr/build`, `dgr.cli.main`, log `dgr: demo: ...` are not commands.\n"
            "```sh\n$ dgr gate alpha\ndgr upstream fetch | verify\ndgr: demo: 3 workers\n```\n"
            "`dgr bench speculate` `dgr frobnicate --x` `dgr certs init /srv/ca && dgr certs issue /srv/ca a`\n")
    found = [w.strip() for _, w in mentions(text)]
    assert found == ["gate alpha", "upstream fetch | verify", "bench frames --rounds 5",
                     "deploy plan deploy/x.toml", "up", "status:", "bench speculate", "frobnicate --x",
                     "certs init /srv/ca", "certs issue /srv/ca a"]
    verdicts = {w: check(w, parser, flags=True) for w in found}
    assert [w for w, why in verdicts.items() if why] == ["bench speculate", "frobnicate --x"]
    assert "no command 'speculate'" in verdicts["bench speculate"]
    assert check("bench frames --no-such-flag", parser, flags=True) == "dgr bench frames has no flag --no-such-flag"
    assert check("bench frames --no-such-flag", parser, flags=False) is None
    assert check("worker serve --bundle B --stage 1", parser, flags=True) is None
    assert check("--version", parser, flags=True) is None
    assert check("bench --speculate mtp --wan-rtt-ms 20", parser, flags=True) is None   # values are not commands
    assert check("0.1.0 (checkout)", parser, flags=True) is None                          # `dgr --version`'s output
