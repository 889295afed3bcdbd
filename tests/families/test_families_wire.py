"""Every ported architecture through real worker processes, with the features that live in the worker.

A 3-stage bundle of its tiny model, one dgr-worker process per stage and three replicas of the middle one,
against the whole model run cold in this process (greedy tokens, every logits row bit for bit):

- cold: the route with the prefix cache off;
- recovery: the first middle replica kills itself (kill -9, the die-at hook) mid-generation; the client
  re-prefills on the next one;
- prefix cache: the prompt again, restoring what the recovered run's stages kept (where the family keeps
  prefixes: docs/families.md's "prefix cache" column, which Describe's `prefix_cache_off` repeats);
- recovery with the cache: a generation that restores its prefix, then loses the second middle replica
  mid-generation and finishes on the third, which holds nothing of it;
- grammar replay: a generation under a grammar loses its last stage (where the grammar lives) mid-generation;
  the next last stage replays the accepted tokens into its grammar and the text equals the undisturbed run's
  (the synthetic vocabulary spells any ASCII text, so a grammar over letters constrains every family);
- speculation (n-gram drafts from a prompt that repeats itself, so drafts are sent and some rejected, rolled back
  on every stage): the same tokens and logits, or refused by name where a stage cannot roll back;
- a lossy wire dtype (bf16, f16, q8_0 in turn over the families: a route has one; docs/wire-dtypes.md measures
  every dtype on every family in-process): the route is not the whole model, but it is itself: a second cold
  run, and a run restoring its kept prefix, equal its first bit for bit.

docs/families.md's in-process columns (tests/families/test_families.py) prove the same engine calls on every stage
of a split; this proves the worker makes them, for every family.
"""

from __future__ import annotations

import numpy as np
import pytest

from dgr.core.errors import WireError
from dgr.runtime.wire.gen import stage_pb2 as pb
from dgr.runtime.wire.stats import draft_stats
from dgr.toolchain.synth.generic import known_archs

from support.route import die_at

pytestmark = [pytest.mark.engine, pytest.mark.slow]

PROMPT_LEN = 70          # two whole prefix blocks (32) and the start of a third
MAX_NEW = 6
CHUNK = 16
LOSSY = ("bf16", "f16", "q8_0")
SPEC_NEW = 12
# "q" once, first, then never again; not complete within the tokens asked (no end of generation is allowed):
# a last stage that restarted the grammar instead of replaying it would write a second "q"
GRAMMAR = 'root ::= "q" [a-pr-z ]{60}'


def _drafted_prompt(eng, ids, whole_model_run):
    """A prompt repeating a piece of `ids` whose greedy continuation (the whole model's) repeats a pair of
    tokens of its history, so n-gram drafting proposes drafts: (prompt, the whole model's run of it, True).
    Some tiny random models never repeat a pair within SPEC_NEW tokens whatever the prompt: (the first
    candidate, its run, False); their speculative run is still compared, with nothing drafted."""
    first = None
    for period in (7, 5, 3, 2, 1):
        loop = (ids[:period] * PROMPT_LEN)[:PROMPT_LEN]
        ref = whole_model_run(eng, loop, SPEC_NEW, chunk_tokens=CHUNK)
        first = first or (loop, ref, False)
        hist = loop + ref.token_ids
        pairs = set(zip(hist, hist[1:PROMPT_LEN]))
        for i in range(PROMPT_LEN, len(hist) - 4):      # with tokens left to draft after it
            if (hist[i - 1], hist[i]) in pairs:
                return loop, ref, True
            pairs.add((hist[i - 1], hist[i]))
    return first


def _same(gen, ref, n_prompt: int, what: str) -> None:
    assert gen.token_ids == ref.token_ids, what
    for k, row in enumerate(ref.logits):
        assert np.array_equal(gen.logits[n_prompt - 1 + k].view(np.uint32), row.view(np.uint32)), f"{what}: row {k}"


@pytest.mark.parametrize("arch", known_archs())
def test_every_family_through_worker_processes_cold_recovered_and_restored(arch, engine_lib, tmp_path, repo_root):
    from dgr.app.demo import whole_model_run
    from dgr.app.local import LocalRoute
    from dgr.runtime.engine import Engine
    from dgr.runtime.wire.client import RouteClient
    from dgr.toolchain.synth.generic import layer_kinds
    from dgr.toolchain.synth.parity import choose_ranges, model_layers, read_table, synth_model

    from support.engine import long_prompts, make_bundle

    layers = model_layers(arch)
    whole = synth_model(arch, tmp_path / f"{arch}.gguf", layers=layers)
    bundle = make_bundle(whole, choose_ranges(layer_kinds(arch, layers), 3), tmp_path)
    eng = Engine.open(whole, lib=engine_lib, n_threads=1)
    try:
        ids = long_prompts(eng.describe().n_vocab, lengths=(PROMPT_LEN,))[0]
        ref = whole_model_run(eng, ids, MAX_NEW, chunk_tokens=CHUNK)  # prefill in the chunks the route uses
        loop, loop_ref, drafts = _drafted_prompt(eng, ids, whole_model_run)
    finally:
        eng.close()
    cell = read_table(repo_root / "docs" / "families.md")[arch]["prefix_cache"]
    keeps = cell == "exact"
    faults = {(1, 0): die_at("victim", PROMPT_LEN, 3), (1, 1): die_at("victim2", PROMPT_LEN, 3),
              (2, 0): die_at("victim3", PROMPT_LEN, 4)}
    args = [["--bundle", str(bundle.root), "--stage", str(i), "--threads", "1", "--n-ctx", "256"] for i in range(3)]
    with LocalRoute(args, replicas=[1, 3, 2], env={"DGR_ENGINE_LIB": str(engine_lib)}, timeout=300,
                    extra=lambda i, k: faults.get((i, k), [])) as r, \
            RouteClient(r.replicas, chunk_tokens=CHUNK) as c:
        d = c.describe()
        rolls_back = all(x.can_roll_back for x in d)
        assert [x.prefix_cache_off == "" for x in d] == [keeps] * 3
        if not keeps:
            assert d[0].prefix_cache_off == f"{arch} is a {cell.removeprefix('refused: ')}"
        run = lambda **kw: c.run(ids, max_new_tokens=MAX_NEW, logits="last", stop_token_ids=[], **kw)  # noqa: E731
        _same(run(prefix_cache=False), ref, PROMPT_LEN, "cold")

        recovered = run(session_id="victim")          # cold (nothing kept yet), then kill -9 mid-generation
        assert recovered.epochs == 2 and recovered.failures[0].stage == 1
        _same(recovered, ref, PROMPT_LEN, "recovered")

        warm = run()                                   # restores what the recovered session's stages kept
        assert warm.cached_tokens == (64 if keeps else 0)
        _same(warm, ref, PROMPT_LEN, "restored")

        both = run(session_id="victim2")              # restores, then loses its middle replica
        assert both.cached_tokens == (64 if keeps else 0)
        assert both.epochs >= 2 and {f.stage for f in both.failures} == {1}   # (the dead first replica may be tried)
        _same(both, ref, PROMPT_LEN, "restored, then recovered")

        if rolls_back:
            spec = c.run(loop, max_new_tokens=SPEC_NEW, logits="last", stop_token_ids=[], speculate="ngram",
                         prefix_cache=False)
            _same(spec, loop_ref, PROMPT_LEN, "speculated")
            assert draft_stats(spec)[0] > 0 or not drafts, "no drafts were verified"
        else:
            with pytest.raises(WireError, match="cannot roll back rejected drafts"):
                c.run(loop, max_new_tokens=SPEC_NEW, speculate="ngram")

        plain = c.run(ids, max_new_tokens=MAX_NEW + 4, grammar=GRAMMAR, prefix_cache=False)
        text = plain.text
        assert len(plain.token_ids) == MAX_NEW + 4 and text[0] == "q" and set(text[1:]) <= set("abcdefghijklmnoprstuvwxyz "), text
        replayed = c.run(ids, max_new_tokens=MAX_NEW + 4, grammar=GRAMMAR, session_id="victim3")
        assert replayed.epochs >= 2 and {f.stage for f in replayed.failures} == {2}
        assert (replayed.token_ids, replayed.text) == (plain.token_ids, text)

    dtype = LOSSY[known_archs().index(arch) % len(LOSSY)]
    args = [[*a, "--wire-dtype", dtype] for a in args]
    with LocalRoute(args, env={"DGR_ENGINE_LIB": str(engine_lib)}, timeout=300) as r, \
            RouteClient(r.addresses, chunk_tokens=CHUNK) as c:
        assert [x.schema_out.dtype for x in c.describe()[:2]] == [pb.Dtype.Value(dtype.upper())] * 2
        run = lambda **kw: c.run(ids, max_new_tokens=MAX_NEW, logits="last", stop_token_ids=[], **kw)  # noqa: E731
        first = run()
        assert first.token_ids != ref.token_ids or any(   # the codecs really ran: not the whole model's bits
            not np.array_equal(first.logits[PROMPT_LEN - 1 + k], row) for k, row in enumerate(ref.logits))
        again, warm = run(prefix_cache=False), run()
        assert warm.cached_tokens == (64 if keeps else 0)
        for other, what in ((again, "lossy, again"), (warm, "lossy, restored")):
            assert other.token_ids == first.token_ids, what
            assert all(np.array_equal(other.logits[p].view(np.uint32), first.logits[p].view(np.uint32))
                       for p in first.logits), what
