"""A synthetic V4 whose MTP drafts agree with the trunk at a chosen rate (dgr.toolchain.synth.deepseek4_agree),
run through the real engine library: the trunk's greedy tokens walk the successor cycle, every draft of
`Engine.mtp_draft` (k = 1..4) at every position of a whole cycle is the one the layout predicts, so the
measured agreement is the designed rate exactly (all for 1.0, none for 0.0), and speculative greedy decoding
(verify, accept, truncate) accepts exactly what the layout predicts. The whole file is opened as the engine
opens an include_mtp last stage (`dgr.mtp` set on a copy); one check goes through a two-stage bundle."""

from __future__ import annotations

import numpy as np
import pytest

from dgr.core.errors import DgrError
from dgr.runtime.engine import Engine
from dgr.runtime.engine_api import Step
from dgr.toolchain.bundle import build
from dgr.toolchain.synth.deepseek4 import make_shape
from dgr.toolchain.synth.deepseek4_agree import (DEFAULT_EMBD, agreeing_values, agreement_layout,
                                                 synth_deepseek4_agreeing)

from support.engine import b3, rewrite_gguf

LAYERS = 6
K = 4
PROMPT = 5
CASES = [(1.0, "random"), (0.8, "random"), (0.5, "random"), (0.0, "random")]


def _ids(case):
    return f"agree{case[0]}-{case[1]}"


# ---- the layout alone (no engine) ----

@pytest.mark.parametrize("agree", [0.0, 0.25, 0.5, 0.8, 1.0])
@pytest.mark.parametrize("spread", ["random", "even"])
def test_the_layout_holds_the_rate_and_its_drafts_never_recover(agree, spread):
    lay = agreement_layout(agree, seed=3, spread=spread)
    n = lay.length
    assert sorted(lay.cycle) == [t for t in range(lay.n_vocab) if t < 264]   # the normal tokens, once each
    assert sum(lay.agree) == round(agree * n) and abs(lay.rate - agree) <= 0.5 / n
    rates = lay.rates(K)
    assert rates[0] == lay.rate
    assert all(a >= b for a, b in zip(rates, rates[1:]))
    for t in lay.cycle[:40]:
        m = lay.matches(t, 8)
        a = lay.accepted(t, 8)
        assert m == [True] * a + [False] * (8 - a)          # after a miss no later draft matches
    if spread == "even" and 0 < agree < 1:                   # any window holds n * r agreeing positions, +- 1
        ag = np.array(lay.agree + lay.agree, dtype=int)
        for w in (5, 17, 50):
            sums = np.convolve(ag, np.ones(w, dtype=int), "valid")[:n]
            assert np.all(np.abs(sums - w * lay.rate) <= 1.0 + 1e-9)
    if spread == "random" and 0 < agree < 1:                 # about independent: draft j matches at ~ r**j
        assert all(abs(r - agree ** (j + 1)) < 0.1 for j, r in enumerate(rates))


def test_control_tokens_lead_into_the_cycle_and_agree():
    lay = agreement_layout(0.0)
    for t in (264, 265, 266):
        assert lay.succ(t) == lay.cycle[0] and lay.draft(t) == lay.cycle[0]
    assert lay.draft(lay.cycle[0]) == lay.cycle[2]


def test_the_values_make_orthonormal_lookup_tables():
    lay = agreement_layout(0.5, seed=1)
    s = make_shape(layers=3, embd=DEFAULT_EMBD, hash_layers=2)
    v = agreeing_values(lay, s, seed=1, logit=10.0)
    emb = v["token_embd.weight"].astype(np.float64)
    assert np.allclose(emb @ emb.T, np.eye(lay.n_vocab), atol=1e-5)
    logits = v["output.weight"] @ (emb.T * np.sqrt(s.embd))             # column t: the trunk's logits after t
    assert [int(i) for i in logits.argmax(0)] == [lay.succ(t) for t in range(lay.n_vocab)]
    assert np.allclose(logits.max(0), 10.0, atol=1e-3)
    eh = v["blk.3.nextn.eh_proj.weight"]
    assert not eh[:, s.embd:].any()
    drafted = (v["output.weight"] @ (eh[:, :s.embd] @ emb.T)).argmax(0)
    assert [int(i) for i in drafted] == [lay.draft(t) for t in range(lay.n_vocab)]
    zeroed = {n for n, a in v.items() if not a.any()}
    assert len(zeroed) == 3 * 4 and "blk.3.attn_output_b.weight" in zeroed


def test_it_refuses_what_it_cannot_build(tmp_path):
    with pytest.raises(DgrError, match="at least the vocabulary"):
        synth_deepseek4_agreeing(tmp_path / "x.gguf", agree=0.5, embd=256)
    with pytest.raises(DgrError, match=r"in \[0, 1\]"):
        synth_deepseek4_agreeing(tmp_path / "x.gguf", agree=1.5)
    with pytest.raises(DgrError, match="MTP block"):
        synth_deepseek4_agreeing(tmp_path / "x.gguf", agree=0.5, mtp=False)
    assert not (tmp_path / "x.gguf").exists()


def test_an_even_spread_phase_locks_a_speculative_run():
    # 0.8 evenly spaced is a period of 4 agreeing positions and 1 not; with 4 drafts a step that starts a run
    # accepts all 4 and the next step starts the next run: a speculative run accepts far more than r + .. + r**4
    lay = agreement_layout(0.8, spread="even")
    acc = lay.speculate(lay.cycle[0], K, 50)
    assert sum(acc) / 50 > 3.5 and sum(lay.rates(K)) < 2.1


def test_the_file_is_deterministic_and_named_by_its_rate(tmp_path):
    import gguf

    from dgr.cli.main import main

    a = synth_deepseek4_agreeing(tmp_path / "a.gguf", agree=0.8, layers=2, hash_layers=1, seed=4)
    b = tmp_path / "b.gguf"
    assert main(["synth", "--arch", "deepseek4", "--mtp-agree", "0.8", "--layers", "2", "--hash-layers", "1",
                 "--seed", "4", "-o", str(b)]) == 0
    assert a.read_bytes() == b.read_bytes()
    name = gguf.GGUFReader(str(a)).fields["general.name"].contents()
    assert name == "dgr-synth-deepseek4-agree0.80-L2+mtp-E272-s4"
    assert main(["synth", "--arch", "llama", "--mtp-agree", "0.5", "-o", str(tmp_path / "c.gguf")]) != 0


# ---- through the engine ----

@pytest.fixture(scope="module", params=CASES, ids=_ids)
def model(request, tmp_path_factory):
    agree, spread = request.param
    tmp = tmp_path_factory.mktemp("v4agree")
    src = synth_deepseek4_agreeing(tmp / "v4.gguf", agree=agree, spread=spread, layers=LAYERS, seed=0)
    # the engine drafts on a file marked as an include_mtp last stage (here: the whole model)
    whole = rewrite_gguf(src, tmp / "v4-mtp.gguf", set_kv={"dgr.mtp": True})
    return agree, agreement_layout(agree, seed=0, spread=spread), whole


def _step(e, pos, toks, want="last"):
    toks = np.asarray(toks, np.int32)
    return e.forward([Step("s", 0, np.arange(pos, pos + len(toks), dtype=np.int32), token_ids=toks,
                           want_logits=want)])[0]


@pytest.mark.engine
def test_drafts_agree_with_the_trunk_at_the_designed_rate(model, engine_lib):
    agree, lay, path = model
    n = lay.length
    with Engine.open(path, n_ctx=512, max_sessions=1, n_draft_max=K, lib=engine_lib) as e:
        assert e.has_mtp
        e.open_session("s", 0)
        prompt = list(lay.cycle[:PROMPT])
        r = _step(e, 0, prompt)
        toks, drafts = [r.next_token], []
        for _ in range(n + K):                  # every cycle token is once the drawn token, K more to check against
            t = toks[-1]
            drafts.append([e.mtp_draft("s", 0, t, k) for k in range(1, K + 1)])
            r = _step(e, PROMPT + len(toks) - 1, [t])
            assert int(np.argmax(r.logits[-1])) == r.next_token
            toks.append(r.next_token)
    # the trunk's greedy text follows the successor cycle
    assert toks == lay.walk(prompt[-1], len(toks))
    assert len(set(toks[:n])) == n
    # the chained drafts: draft k of mtp_draft(k) is the one mtp_draft(k + 1) drafts at k
    for ds in drafts:
        assert all(ds[k - 1] == ds[K - 1][:k] for k in range(1, K + 1)), ds
    got = np.array([[ds[K - 1][j] == toks[i + 1 + j] for j in range(K)] for i, ds in enumerate(drafts[:n])])
    want = np.array([lay.matches(toks[i], K) for i in range(n)])
    assert np.array_equal(got, want)          # every position's draft as designed
    rates = got.mean(axis=0)
    print(f"agree {agree}: draft j=1..{K} matches at {np.round(rates, 4).tolist()} over a cycle of {n}")
    assert rates[0] == lay.rate and abs(rates[0] - agree) <= 0.5 / n
    assert np.allclose(rates, lay.rates(K))
    if agree == 1.0:
        assert got.all()
    if agree == 0.0:
        assert not got.any()


@pytest.mark.engine
def test_speculative_decoding_accepts_what_the_layout_predicts(model, engine_lib):
    agree, lay, path = model
    steps = 60
    with Engine.open(path, n_ctx=512, max_sessions=1, n_draft_max=K, lib=engine_lib) as e:
        e.open_session("s", 0)
        prompt = list(lay.cycle[:PROMPT])
        r = _step(e, 0, prompt)
        toks, acc, n_past = [r.next_token], [], PROMPT
        for _ in range(steps):
            d = e.mtp_draft("s", 0, toks[-1], K)
            r = _step(e, n_past, [toks[-1], *d], want="all")
            j = 0
            while j < K and int(np.argmax(r.logits[j])) == d[j]:
                j += 1
            toks += d[:j] + [int(np.argmax(r.logits[j]))]
            acc.append(j)
            n_past += j + 1
            if j < K:
                e.truncate("s", 0, n_past)
            assert e.n_cached("s", 0) == n_past
    assert acc == lay.speculate(toks[0], K, steps)
    assert toks == [toks[0]] + lay.walk(toks[0], len(toks) - 1)
    print(f"agree {agree}: {sum(acc) / steps:.3f} drafts accepted per step of {K} "
          f"(iid model: {sum(agree ** j for j in range(1, K + 1)):.3f})")
    if agree == 1.0:
        assert acc == [K] * steps
    if agree == 0.0:
        assert acc == [0] * steps


@pytest.mark.engine
def test_a_two_stage_include_mtp_bundle_drafts_as_designed(tmp_path, engine_lib):
    src = synth_deepseek4_agreeing(tmp_path / "v4.gguf", agree=0.5, layers=LAYERS, seed=2)
    lay = agreement_layout(0.5, seed=2)
    recipe = tmp_path / "v4.toml"
    recipe.write_text(f'name = "v4"\n\n[source]\nuri = "{src}"\nblake3 = "{b3(src)}"\n\n[placement]\n'
                      f"stages = [[0, 3], [3, {LAYERS}]]\n\n[bundle]\ninclude_mtp = true\n")
    paths = build(recipe, tmp_path / "store").stage_paths
    engines = [Engine.open(p, n_ctx=256, max_sessions=1, n_draft_max=K, lib=engine_lib) for p in paths]
    try:
        assert engines[-1].has_mtp
        for e in engines:
            e.open_session("s", 0)

        def chain(pos: int, toks: list[int]):
            bound = None
            for e in engines:
                t = np.asarray(toks, np.int32)
                first = e.describe().is_first
                res = e.forward([Step("s", 0, np.arange(pos, pos + len(t), dtype=np.int32),
                                      token_ids=t if first or e.describe().needs_token_ids else None,
                                      boundary=bound, want_logits="last")])[0]
                bound = res.boundary
            return res.next_token

        toks = [chain(0, list(lay.cycle[:PROMPT]))]
        got = []
        for _ in range(40):
            got.append(engines[-1].mtp_draft("s", 0, toks[-1], K))
            toks.append(chain(PROMPT + len(toks) - 1, [toks[-1]]))
    finally:
        for e in engines:
            e.close()
    assert toks == [toks[0]] + lay.walk(toks[0], len(toks) - 1)
    assert got == [lay.drafts(t, K) for t in toks[:-1]]
