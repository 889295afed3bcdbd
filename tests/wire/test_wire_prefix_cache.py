"""The prefix cache on every stage (issue 23, docs/worker.md "Prefix cache"), across real dgr-worker processes
serving SmolLM2 split in three.

A session whose prompt begins with tokens an earlier session ran starts from what every stage kept and
prefills only the rest; its tokens and every logits row are bit-identical to a cold prefill of the same
prompt (the same route with the cache unused). A stage that kept less (or nothing) makes the route start
from what every stage holds; a cache too small for a state keeps older ones and evicts least recently used.
"""

from __future__ import annotations

import numpy as np
import pytest

from dgr.app.local import LocalRoute
from dgr.runtime.wire.client import RouteClient
from dgr.runtime.wire.gen import stage_pb2 as pb
from dgr.runtime.wire.limits import Limits
from dgr.runtime.wire.prefix import PREFIX_BLOCK_TOKENS, block_hashes, prompt_blocks

pytestmark = [pytest.mark.engine, pytest.mark.slow]

SYSTEM = ("<|im_start|>system\nYou are a careful assistant. You answer briefly and plainly, in English, and you "
          "say so when you do not know something. Never invent facts.<|im_end|>\n")
MAX_NEW = 12


def _route(engine_lib, flags=lambda stage: []):
    from dgr.app.demo import ensure_bundle

    b = ensure_bundle(3, progress=False)[0]
    return LocalRoute([["--bundle", str(b.root), "--stage", str(i), "--threads", "1", "--n-ctx", "1024",
                        *flags(i)] for i in range(3)], env={"DGR_ENGINE_LIB": str(engine_lib)}, timeout=300)


def _turn(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def _same(a, b):
    assert a.token_ids == b.token_ids and a.text == b.text
    assert sorted(a.logits) == sorted(b.logits)
    for p in a.logits:
        assert np.array_equal(a.logits[p].view(np.uint32), b.logits[p].view(np.uint32)), f"position {p}"


def _describe(c: RouteClient, address: str) -> pb.StageDescription:
    return c._stub(address).Describe(pb.DescribeRequest(), timeout=10)


def _run(c, ids, **kw):
    kw.setdefault("max_new_tokens", MAX_NEW)
    return c.run(ids, logits="last", stop_token_ids=[], **kw)


def test_blocks_are_a_chain_over_whole_blocks_and_the_prompts_last_token_is_never_cached():
    ids = list(range(100, 100 + 3 * PREFIX_BLOCK_TOKENS + 5))
    hs = block_hashes(ids)
    assert len(hs) == 3 and len(set(hs)) == 3
    assert block_hashes(ids[: 2 * PREFIX_BLOCK_TOKENS]) == hs[:2]          # a shared prefix shares its hashes
    other = list(ids)
    other[5] += 1
    assert not set(block_hashes(other)) & set(hs)                          # one token changes every later block
    assert len(prompt_blocks(ids[: 2 * PREFIX_BLOCK_TOKENS])) == 1         # the last token stays to be computed
    assert len(prompt_blocks(ids[: 2 * PREFIX_BLOCK_TOKENS + 1])) == 2


def test_a_conversation_restores_its_history_on_every_stage_and_equals_a_cold_prefill(engine_lib):
    with _route(engine_lib) as r, RouteClient(r.addresses) as c:
        prompt = c.tokenize(SYSTEM + _turn("Name three rivers in Europe."))
        first = _run(c, prompt)
        assert first.cached_tokens == 0
        again = _run(c, prompt)                       # the same prompt: its whole blocks, all but the last token
        assert again.cached_tokens == (len(prompt) - 1) // PREFIX_BLOCK_TOKENS * PREFIX_BLOCK_TOKENS > 0
        _same(again, first)
        # turn 2 resends turn 1 and its answer: the cache holds the blocks turn 1's session ran
        turn2 = prompt + first.token_ids + c.tokenize(_turn("Which is the longest?"), False)
        warm = _run(c, turn2)
        ran = len(prompt) + len(first.token_ids) - 1
        assert warm.cached_tokens == min(ran, len(turn2) - 1) // PREFIX_BLOCK_TOKENS * PREFIX_BLOCK_TOKENS
        cold = _run(c, turn2, prefix_cache=False)
        assert cold.cached_tokens == 0
        _same(warm, cold)
        d = [_describe(c, a) for a in r.addresses]
        assert all(x.prefix_cache_capacity_bytes == Limits().prefix_cache_mib << 20 for x in d)   # the default
        assert all(x.prefix_cache_entries >= 1 and 0 < x.prefix_cache_bytes <= x.prefix_cache_capacity_bytes
                   for x in d)
        assert [x.prefix_cache_hits for x in d] == [2, 2, 2]


def test_a_stage_that_kept_less_bounds_what_the_route_restores(engine_lib):
    """Stage 2's cache holds about 100 positions, the others much more: stage 0 and 1 restore their long prefix,
    then drop back to what stage 2 holds; the text is still the cold one."""
    with _route(engine_lib, lambda stage: ["--prefix-cache-mib", "1" if stage == 2 else "64"]) as r, \
            RouteClient(r.addresses) as c:
        short = c.tokenize(SYSTEM + _turn("Say hi."))
        assert PREFIX_BLOCK_TOKENS < len(short) < 3 * PREFIX_BLOCK_TOKENS
        _run(c, short, max_new_tokens=4)               # every stage keeps it (about 1 MiB covers ~130 positions)
        long = short + c.tokenize("Now tell me, in detail, about the history of the printing press. " * 6, False)
        _run(c, long, max_new_tokens=4)                # stage 2 cannot keep this one: too large for 1 MiB
        assert _describe(c, r.addresses[2]).prefix_cache_entries == 1
        warm = _run(c, long)
        assert warm.cached_tokens == (len(short) + 4 - 1) // PREFIX_BLOCK_TOKENS * PREFIX_BLOCK_TOKENS
        _same(warm, _run(c, long, prefix_cache=False))


def test_a_stage_without_a_cache_means_a_cold_prefill_everywhere(engine_lib):
    with _route(engine_lib, lambda stage: ["--prefix-cache-mib", "0"] if stage == 1 else []) as r, \
            RouteClient(r.addresses) as c:
        prompt = c.tokenize(SYSTEM + _turn("Count to five."))
        first = _run(c, prompt)
        again = _run(c, prompt)
        assert again.cached_tokens == 0               # stage 0 restored, then dropped it: stage 1 had nothing
        _same(again, first)
        assert _describe(c, r.addresses[1]).prefix_cache_capacity_bytes == 0
        assert _describe(c, r.addresses[0]).prefix_cache_hits == 1


def test_least_recently_used_states_leave_first(engine_lib):
    with _route(engine_lib, lambda stage: ["--prefix-cache-mib", "2"]) as r, RouteClient(r.addresses) as c:
        # different from their first block on (no shared system prompt): nothing of one serves another
        prompts = [c.tokenize(_turn(f"Question number {k}: what is {k} times {k}? " * 4)) for k in range(4)]
        firsts = [_run(c, p) for p in prompts]
        d = _describe(c, r.addresses[0])
        assert 1 <= d.prefix_cache_entries < 4 and d.prefix_cache_bytes <= 2 << 20   # not all of them fit
        newest = _run(c, prompts[-1])
        assert newest.cached_tokens > 0
        _same(newest, firsts[-1])
        oldest = _run(c, prompts[0])                  # evicted: an ordinary miss, the same text
        assert oldest.cached_tokens == 0
        _same(oldest, firsts[0])


def test_a_conversation_lands_again_on_the_replicas_that_kept_its_history(engine_lib):
    """Stages 1 and 2 have two replicas each. A conversation ran on the second ones; a client that shares the
    gateway's memory of where prefixes were left (PrefixRoutes) continues it there and restores it, while a
    client without it goes to the first replicas, which hold nothing of it."""
    from dgr.app.demo import ensure_bundle
    from dgr.runtime.wire.client import PrefixRoutes

    b = ensure_bundle(3, progress=False)[0]
    with LocalRoute([["--bundle", str(b.root), "--stage", str(i), "--threads", "1", "--n-ctx", "1024"]
                     for i in range(3)], env={"DGR_ENGINE_LIB": str(engine_lib)}, timeout=300,
                    replicas=[1, 2, 2]) as r:
        firsts = [row[0] for row in r.replicas]
        seconds = [[row[-1], row[0]] for row in r.replicas]        # the other replica first
        where = PrefixRoutes()
        with RouteClient(seconds, prefix_routes=where) as c:
            prompt = c.tokenize(SYSTEM + _turn("Name three rivers in Europe."))
            first = _run(c, prompt)
            left_on = list(c.route)
        assert left_on == [row[-1] for row in r.replicas]
        turn2 = prompt + first.token_ids + RouteClient(firsts).tokenize(_turn("Which is longest?"), False)
        with RouteClient([[a] + [x for x in row if x != a] for a, row in zip(firsts, r.replicas)],
                         prefix_routes=where) as c:
            warm = _run(c, turn2)
            assert c.route == left_on and warm.cached_tokens > 0
        with RouteClient([[a] + [x for x in row if x != a] for a, row in zip(firsts, r.replicas)]) as c:
            elsewhere = _run(c, turn2)
            assert c.route == firsts and elsewhere.cached_tokens == 0
        _same(warm, elsewhere)


def _synth_route(arch, engine_lib, tmp_path, n_stages):
    from dgr.toolchain.synth.generic import layer_kinds
    from dgr.toolchain.synth.parity import choose_ranges, model_layers, synth_model

    from support.engine import make_bundle

    layers = model_layers(arch)
    whole = synth_model(arch, tmp_path / f"{arch}.gguf", layers=layers)
    bundle = make_bundle(whole, choose_ranges(layer_kinds(arch, layers), n_stages), tmp_path)
    args = [["--bundle", str(bundle.root), "--stage", str(i), "--threads", "1", "--n-ctx", "512"]
            for i in range(n_stages)]
    return LocalRoute(args, env={"DGR_ENGINE_LIB": str(engine_lib)}, timeout=300)


@pytest.mark.parametrize("arch", ["gemma3", "cohere2", "gpt-oss", "llama4"])
def test_sliding_window_and_chunked_attention_restore_exactly(arch, engine_lib, tmp_path):
    """Issue 41's reproduction on tiny models of sliding-window (gemma3: interleaved local/global, cohere2:
    global layers without RoPE, gpt-oss: with attention sinks) and chunked attention (llama4), 3 worker
    processes: a long prompt cold, a shorter one sharing its start, then the long one again (restoring the
    shorter one's blocks: a restore cut back past the window), and a prompt cut back inside the long one's
    blocks. Every run's tokens and logits equal the cold ones."""
    from support.engine import long_prompts

    with _synth_route(arch, engine_lib, tmp_path, 3) as r, RouteClient(r.addresses, chunk_tokens=16) as c:
        assert all(d.prefix_cache_capacity_bytes > 0 and d.prefix_cache_off == "" for d in c.describe())
        long = long_prompts(c.hops[0].n_vocab, lengths=(150,))[0]
        cold = _run(c, long, max_new_tokens=6, prefix_cache=False)
        _run(c, long[:70], max_new_tokens=6)
        after_short = _run(c, long, max_new_tokens=6)
        assert after_short.cached_tokens == 64
        _same(after_short, cold)
        again = _run(c, long, max_new_tokens=6)
        assert again.cached_tokens == 128
        _same(again, cold)
        cut = _run(c, long[:100], max_new_tokens=6)
        assert cut.cached_tokens == 96
        _same(cut, _run(c, long[:100], max_new_tokens=6, prefix_cache=False))


@pytest.mark.parametrize("arch", ["mamba", "jamba"])
def test_recurrent_and_hybrid_stages_keep_nothing_and_the_route_prefills_in_full(arch, engine_lib, tmp_path,
                                                                                 repo_root):
    """docs/families.md, "Prefix cache": a stage whose state is one running state per session keeps nothing
    (Describe says capacity 0 and why, in the table's words), so a repeated prompt is prefilled again, with
    the same text."""
    from dgr.toolchain.synth.parity import read_table

    from support.engine import long_prompts

    why = read_table(repo_root / "docs" / "families.md")[arch]["prefix_cache"].removeprefix("refused: ")
    with _synth_route(arch, engine_lib, tmp_path, 2) as r, RouteClient(r.addresses, chunk_tokens=16) as c:
        assert [d.prefix_cache_capacity_bytes for d in c.describe()] == [0, 0]
        assert [d.prefix_cache_off for d in c.describe()] == [f"{arch} is a {why}"] * 2
        ids = long_prompts(c.hops[0].n_vocab, lengths=(70,))[0]
        first, again = _run(c, ids, max_new_tokens=4), _run(c, ids, max_new_tokens=4)
    assert first.cached_tokens == again.cached_tokens == 0
    _same(again, first)


def test_a_k_quant_sliding_window_model_of_a_real_shape_restores_exactly(engine_lib, tmp_path):
    """Issue 41's reproduction at a real model's shape: gemma3-like (18 layers, 5 local : 1 global, a 128-position
    window, width 640), every matrix Q4_K by llama.cpp's quantizer, 3 workers. A long prompt cold; a shorter one
    sharing its start; the long one again, restoring the shorter one's blocks (a restore cut back past the window);
    the long one restored whole. Tokens and every logits row equal the cold run's."""
    from dgr.runtime.engine import quantize
    from dgr.toolchain.synth.generic import layer_kinds, synth
    from dgr.toolchain.synth.parity import choose_ranges

    from support.engine import make_bundle

    f32 = synth("gemma3", 18, 640, 5, tmp_path / "g3.gguf", n_ff=1024, swa=128, swa_pattern=6, context=2048)
    model = quantize(f32, tmp_path / "g3-q4k.gguf", "Q4_K", lib=engine_lib)
    bundle = make_bundle(model, choose_ranges(layer_kinds("gemma3", 18, 640), 3), tmp_path)
    args = [["--bundle", str(bundle.root), "--stage", str(i), "--threads", "1", "--n-ctx", "1024"] for i in range(3)]
    with LocalRoute(args, env={"DGR_ENGINE_LIB": str(engine_lib)}, timeout=300) as r, \
            RouteClient(r.addresses, chunk_tokens=64) as c:
        long = [int(t) for t in np.random.default_rng(1).integers(0, c.hops[0].n_vocab, size=420)]
        cold = _run(c, long, prefix_cache=False)
        _run(c, long[:230])
        after_short = _run(c, long)
        assert after_short.cached_tokens == 224
        _same(after_short, cold)
        again = _run(c, long)
        assert again.cached_tokens == 416
        _same(again, cold)
