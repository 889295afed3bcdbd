"""Helpers of the certification tests: the `dgr` command line with the certify area, test contracts, and a
tiny llama bundle to certify in seconds."""

from __future__ import annotations

import re
from pathlib import Path

# A contract for tests: the same shape as certification/alpha.toml, small prompts, speed rows on every
# bundle (synthetic ones too) with thresholds of 0, which any measurement meets (a ratio >= 0 always
# holds). No test judges this machine's speed: a test that needs a failing speed row gives the numbers
# (monkeypatching dgr.app.certify.runner.measure_speed), and dgr.app.certify.speed_figures is tested with given ones.
TEST_CONTRACT = """\
name = "test"
lane = "cpu"
threads_per_process = 1

[parity]
prompts = ["The three primary colors are"]
random_prompts = [80]          # its first 40 tokens share a whole prefix block (32) with it: the prefix-cache row
seed = 3
max_new_tokens = 6
chunk_tokens = 16
n_ctx = 256

[speed]
applies_to = "all"
prompt = "Hello there"
decode_tokens = 4
prefill_tokens = 48
repeats = 1
decode_ratio_min = {decode}
prefill_ratio_min = {prefill}
"""


def write_contract(path: Path, decode: float = 0.0, prefill: float = 0.0) -> Path:
    path.write_text(TEST_CONTRACT.format(decode=decode, prefill=prefill))
    return path


def tiny_llama_bundle(root: Path, ranges=((0, 2), (2, 4), (4, 6))):
    """A 6-layer random-weight llama (`dgr synth`) split at `ranges`, built by dgr.toolchain.bundle.build."""
    from support.engine import make_bundle, synth_model

    root.mkdir(parents=True, exist_ok=True)
    src = synth_model(root, "llama")
    return make_bundle(src, list(ranges), root / "store", name="tiny-llama")


def dgr(argv: list[str]) -> int:
    """`dgr ARGV` in this process; the exit code."""
    from dgr.cli.main import main

    return main(argv)


def table_rows(out: str) -> dict[str, list[str]]:
    """A gate's printed table: check -> [figure, threshold, pass] (columns split on 2+ spaces)."""
    rows = {}
    for line in out.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) == 4 and cells[3] in ("yes", "NO", "inconclusive"):
            rows[cells[0]] = cells[1:]
    return rows
