"""What an engine holds of its model in memory: each weight once.

A weight the CPU backend keeps in a buffer of its own (the invariant kernels' repacked Q4_K) is copied out of
the file's mapping when the model loads; the mapping's pages it came from must not stay in the process beside
the copy (patch 0032), or a stage's RSS is its weights twice over (docs/bench.md, RSS per stage)."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import pytest
from dgr.runtime.engine import Engine, quantize
from dgr.toolchain.synth.generic import synth

pytestmark = pytest.mark.engine

PAGE = os.sysconf("SC_PAGE_SIZE")


def _mapped_rss(path: Path) -> int:
    """Bytes of `path`'s mappings resident in this process (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and ":" in head[3]:   # a mapping's first line
            inside = len(head) >= 6 and os.path.realpath(head[5]) == str(path.resolve())
        elif inside and head and head[0] == "Rss:":
            total += int(head[1]) * 1024
    return total


def _repacked_bytes(path: Path) -> int:
    """The bytes of the weights the invariant kernels repack on this build (Q4_K matrices with rows in eights,
    not the token embedding: test_engine_invariance.py's _expected_kernel)."""
    r = gguf.GGUFReader(path)
    return sum(int(t.n_bytes) for t in r.tensors
               if t.tensor_type.name == "Q4_K" and len(t.shape) >= 2 and t.shape[1] % 8 == 0
               and t.name != "token_embd.weight")


def test_a_repacked_weight_is_not_also_held_in_the_files_pages(engine_lib, tmp_path):
    model = quantize(synth("llama", 4, 512, 1, tmp_path / "llama512.gguf"), tmp_path / "q4k.gguf", "Q4_K",
                     lib=engine_lib)
    size, repacked = model.stat().st_size, _repacked_bytes(model)
    assert repacked > size // 2                       # the check below can tell the two apart
    with Engine.open(model, n_ctx=64, kernels="reference", lib=engine_lib):
        whole = _mapped_rss(model)                    # nothing copied out: the mapping is read in place
    with Engine.open(model, n_ctx=64, kernels="invariant", lib=engine_lib) as e:
        assert "repacked" in e.describe().matmul_kernels
        held = _mapped_rss(model)
    tensors = len(gguf.GGUFReader(model).tensors)
    slack = 2 * PAGE * tensors                        # a page a copied weight shares with a neighbour stays
    assert whole > repacked, (whole, repacked)
    assert held <= size - repacked + slack, (
        f"the file's pages still hold {held} bytes beside {repacked} bytes of repacked copies "
        f"(a {size}-byte model; at most {size - repacked + slack} expected)")
