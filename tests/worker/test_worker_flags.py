"""`dgr worker serve` is the typed front end of `dgr-worker` "with the same flags" (issue 21): every flag one
of them takes, the other takes too, and what the front end passes on, dgr-worker accepts. The real binary
is asked (`dgr-worker FLAGS --help` parses every flag before it prints its usage), so a flag added to one
side only, or a value the front end writes in a form dgr-worker cannot read, fails here by name."""

from __future__ import annotations

import argparse
import re
import subprocess

import pytest

from dgr.cli.commands.worker import _FRONT_END_ONLY, worker_argv
from dgr.cli.main import build_parser

# accepted by dgr-worker but kept out of its usage text: tests' hooks (--test-*), the front end's own
# `--no-verify` after it hashed the bundle, and `--blake3 FILE` (a digest tool for the release tests)
HIDDEN = re.compile(r"^--(test-|no-verify$|blake3$)")

SAMPLE = {"--listen": "127.0.0.1:0", "--wire-dtype": "f16", "--lane": "cpu", "--advertise": "stage1.example:7001",
          "--fake-engine": "layers=4,embd=8,cuts=2", "--stage": "1", "--bundle": "some-bundle",
          "--max-message-bytes": "1000000", "--peer-allow": "10.0.0.0/8,fd00::/8", "--kernels": "fast"}


def _serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    worker = sub.choices["worker"]
    wsub = next(a for a in worker._actions if isinstance(a, argparse._SubParsersAction))
    return wsub.choices["serve"]


def _front_end_flags() -> dict[str, argparse.Action]:
    return {a.option_strings[-1]: a for a in _serve_parser()._actions
            if a.option_strings and a.dest not in _FRONT_END_ONLY and a.dest != "help"}


def _usage_flags(worker_bin) -> set[str]:
    out = subprocess.run([str(worker_bin), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", out.stdout)) - {"--help"}


def test_the_front_end_and_dgr_worker_name_the_same_flags(worker_bin):
    front = {f for f in _front_end_flags() if not HIDDEN.match(f)}
    worker = _usage_flags(worker_bin)
    assert front - worker == set(), "dgr worker serve takes these, dgr-worker's usage does not name them"
    # --probe HOST:PORT is a mode of its own (a health check of a worker, the Kubernetes render's exec probe), not
    # one of serve's flags
    assert worker - front - {"--no-verify", "--probe"} == set(), "dgr-worker takes these, dgr worker serve does not"


def _sample(flag: str, action: argparse.Action) -> list[str]:
    if isinstance(action, argparse._StoreTrueAction):
        return [flag]
    if flag.startswith("--test-"):
        return [flag, "s-1:2:3"]
    if flag in SAMPLE:
        return [flag, SAMPLE[flag]]
    return [flag, "1.5" if action.type is float else "3" if action.type is int else "x"]


def test_every_flag_the_front_end_passes_is_one_dgr_worker_reads(worker_bin):
    argv: list[str] = []
    for flag, action in _front_end_flags().items():
        if flag != "--bundle":                       # (one of --bundle and --fake-engine)
            argv += _sample(flag, action)
    args = _serve_parser().parse_args(argv)
    passed = worker_argv(args)
    for flag in _front_end_flags():
        if flag != "--bundle":
            assert flag in passed, f"dgr worker serve {flag} is not passed on to dgr-worker"
    out = subprocess.run([str(worker_bin), *passed, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"dgr-worker refused what dgr worker serve passed: {out.stderr.strip()}\n{passed}"
    assert out.stdout.startswith("usage: dgr-worker")


@pytest.mark.parametrize("flag", ["--advertise", "--max-connections", "--max-rpc-threads", "--send-timeout",
                                  "--max-send-queue-bytes", "--handshake-timeout", "--max-rpc-memory-mib",
                                  "--peer-allow", "--max-grammar-bytes", "--max-grammar-depth",
                                  "--max-sessions-per-member"])
def test_a_bound_not_given_is_left_to_dgr_worker(flag):
    """These have their defaults in dgr-worker alone (one source): the front end passes them only when given."""
    args = _serve_parser().parse_args(["--fake-engine", "layers=4,embd=8,cuts=2", "--stage", "0"])
    assert flag not in worker_argv(args)


def test_a_polling_level_outside_0_to_100_is_refused_by_name(worker_bin):
    out = subprocess.run([str(worker_bin), "--poll", "101", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "argument --poll: must be 0-100, got 101" in out.stderr, out
