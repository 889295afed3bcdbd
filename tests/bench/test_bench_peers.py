"""`dgr bench peers`: a dgr route and llama.cpp's own RPC backend (built from the pinned tree) on the same model,
hosts and threads, through counting links. What is asserted is what each design sends, not how fast it is: the
star's last server ships the logits row back every token, the ring's hops carry a boundary of n_embd values."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def test_peers_measures_both_sides_and_counts_what_each_link_carries(tmp_path, smollm2_gguf):
    from dgr.app.bench.peers import bench_peers, plot, table
    from dgr.runtime.engine import Engine

    eng = Engine.open(smollm2_gguf, n_threads=1, n_ctx=64)
    try:
        vocab, embd = eng.describe().n_vocab, eng.describe().n_embd
    finally:
        eng.close()
    rep = bench_peers(smollm2_gguf, hosts=3, rtts=(0.0,), prompts=(64,), tokens=6, store=tmp_path / "store",
                      kernels="invariant", chunk_tokens=32, speculate="ngram")
    [run] = rep["runs"]
    dgr, rpc = run["dgr"], run["rpc"]
    assert dgr["tpot_ms"] > 0 and rpc["tpot_ms"] > 0 and set(dgr["ttft_ms"]) == set(rpc["ttft_ms"]) == {"64"}
    assert dgr["decode_tok_s_4"] > 0 and rpc["decode_tok_s_4"] > 0
    # the ring: the client's link to stage 0 and one link per hop after it; the star: one link per server
    assert len(dgr["link_bytes_per_token"]) == 3 and len(rpc["link_bytes_per_token"]) == 2
    # RPC's last server sends the whole logits row (n_vocab floats) back every token; a dgr hop a boundary row
    assert rpc["link_bytes_per_token"][-1] >= 4 * vocab
    assert all(b < 4 * vocab / 8 for b in dgr["link_bytes_per_token"])
    assert all(b >= 4 * embd for b in dgr["link_bytes_per_token"][1:])
    assert all(t >= 0.9 for t in rpc["link_round_trips_per_token"])
    assert "| 0 | dgr/rpc |" in table(rep)
    # the route ran on the invariant kernels; with n-gram drafts the repetitive workload's text is unchanged and
    # the drafts were taken (more than one token per ring)
    assert rep["kernels"] == "invariant" and rep["chunk_tokens"] == 32
    assert dgr["spec_same_text"] is True and dgr["tpot_spec_ms"] > 0 and dgr["spec_tokens_per_ring"] > 1.0
    assert "| 0 | dgr ngram/rpc |" in table(rep)
    assert plot(rep, tmp_path / "peers.png").stat().st_size > 1000
    assert rep["numerics"].startswith("cpu/x86-64-v3 ")


def test_peers_refuses_a_kernel_set_that_is_not_exact(smollm2_gguf):
    from dgr.app.bench.peers import bench_peers
    from dgr.core.errors import DgrError

    with pytest.raises(DgrError, match="kernels 'fast': choose an exact set, one of reference, invariant"):
        bench_peers(smollm2_gguf, kernels="fast")
