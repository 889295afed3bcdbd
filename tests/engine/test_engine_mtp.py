"""MTP in the engine (issue 22, item 1, the engine part): the last stage of an include_mtp bundle owns the MTP
block, its own MTP context and KV per (session, epoch), feeds it every position it computes, drafts with
`Engine.mtp_draft`, and rolls it back with `truncate` (docs/deepseek4.md section 4). Speculative greedy
generation through both stages of a synthetic V4 gives the plain run's tokens and bit-identical logits, at
every rollback depth; a stage without MTP refuses to draft, naming bundle.include_mtp."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dgr.core.errors import CacheMiss, EngineError, SchemaMismatch
from dgr.runtime.engine import Engine
from dgr.runtime.engine_api import Step
from dgr.toolchain.bundle import build
from dgr.toolchain.synth.deepseek4 import synth_deepseek4
from support.engine import b3, rewrite_gguf

pytestmark = pytest.mark.engine

LAYERS = 4
K = 3
N_GEN = 16
PROMPTS = {"a": 118, "b": 37}   # "a" crosses position 127, where V4's 128-ratio compressor closes a block


def _bundle(root: Path, src: Path, cut: int, mtp: bool):
    root.mkdir(parents=True, exist_ok=True)
    r = root / "v4.toml"
    r.write_text(f'name = "v4"\n\n[source]\nuri = "{src}"\nblake3 = "{b3(src)}"\n\n[placement]\n'
                 f"stages = [[0, {cut}], [{cut}, {LAYERS}]]\n\n[bundle]\ninclude_mtp = {'true' if mtp else 'false'}\n")
    return build(r, root / "store")


# the last stage [2, 4) owns hash layer 2 (its main graph reads the ids too); [3, 4) owns none (the ids go to
# the MTP context only)
@pytest.fixture(scope="module", params=[2, 3], ids=["last-in-hash", "last-past-hash"])
def bundles(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("v4mtp-engine")
    src = synth_deepseek4(tmp / "v4.gguf", layers=LAYERS, hash_layers=3)
    cut = request.param
    return _bundle(tmp / "on", src, cut, True).stage_paths, _bundle(tmp / "off", src, cut, False).stage_paths


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(5)
    return {sid: rng.integers(0, 256, size=n).astype(np.int32) for sid, n in PROMPTS.items()}


def _open(paths, lib, n_draft_max=0):
    return [Engine.open(p, n_ctx=256, max_sessions=3, n_draft_max=n_draft_max, lib=lib) for p in paths]


def _chain(engines, steps, want):
    """One forward of several sessions' (sid, first position, token ids) through every stage: the last
    stage's results."""
    bounds = [None] * len(steps)
    for e in engines:
        info = e.describe()
        res = e.forward([Step(sid, 0, np.arange(p0, p0 + len(t), dtype=np.int32),
                              token_ids=t if info.is_first or info.needs_token_ids else None,
                              boundary=bounds[k], want_logits=want) for k, (sid, p0, t) in enumerate(steps)])
        bounds = [r.boundary for r in res]
    return res


def _plain(engines, prompts, n):
    """Greedy, one token per step: tokens, and the logits row that chose each."""
    out = {}
    for sid, p in prompts.items():
        for e in engines:
            e.open_session(sid, 0)
        r = _chain(engines, [(sid, 0, p)], "last")[0]
        toks, rows = [r.next_token], [r.logits[-1]]
        while len(toks) < n:
            r = _chain(engines, [(sid, len(p) + len(toks) - 1, np.array(toks[-1:], np.int32))], "last")[0]
            toks.append(r.next_token)
            rows.append(r.logits[-1])
        out[sid] = (toks, rows)
        for e in engines:
            e.close_session(sid, 0)
    return out


def _speculative(engines, prompts, ref=None):
    """Both sessions together: draft K with MTP after each token, verify [t, d1..dK] as one step through both
    stages, accept the longest prefix the greedy choice agrees with, truncate both stages to it. With `ref`
    (the plain run) the drafts are overridden so that the n-th step accepts n % (K+1) of them."""
    last = engines[-1]
    n_vocab = last.describe().n_vocab
    for sid in prompts:
        for e in engines:
            e.open_session(sid, 0)
    res = _chain(engines, [(sid, 0, p) for sid, p in prompts.items()], "last")
    st = {sid: {"toks": [r.next_token], "rows": [r.logits[-1]], "n_past": len(p), "acc": []}
          for (sid, p), r in zip(prompts.items(), res)}
    while any(len(s["toks"]) < N_GEN for s in st.values()):
        act = [sid for sid in prompts if len(st[sid]["toks"]) < N_GEN]
        drafts = {}
        for sid in act:
            s = st[sid]
            d = last.mtp_draft(sid, 0, s["toks"][-1], K)
            assert len(d) == K and all(0 <= x < n_vocab for x in d)
            if ref is not None:
                m, c = len(s["acc"]) % (K + 1), len(s["toks"])
                truth = ref[sid][0][c:c + K]
                d = [truth[i] if i < m else (truth[i] + 1) % n_vocab for i in range(K)]
            drafts[sid] = d
        res = _chain(engines, [(sid, st[sid]["n_past"], np.array([st[sid]["toks"][-1], *drafts[sid]], np.int32))
                               for sid in act], "all")
        for sid, r in zip(act, res):
            s, d = st[sid], drafts[sid]
            assert r.logits.shape[0] == K + 1
            j = 0
            while j < K and int(np.argmax(r.logits[j])) == d[j]:
                j += 1
            s["toks"] += d[:j] + [int(np.argmax(r.logits[j]))]
            s["rows"] += list(r.logits[: j + 1])
            s["acc"].append(j)
            keep = s["n_past"] + j + 1
            if j < K:
                for e in engines:
                    e.truncate(sid, 0, keep)
            for e in engines:
                assert e.n_cached(sid, 0) == keep
            s["n_past"] = keep
    return st


def _check_same(st, ref):
    for sid, s in st.items():
        toks, rows = ref[sid]
        assert s["toks"][:N_GEN] == toks[:N_GEN], (sid, s["acc"])
        for i in range(N_GEN):
            assert np.array_equal(s["rows"][i], rows[i]), (sid, i, float(np.abs(s["rows"][i] - rows[i]).max()))


@pytest.fixture(scope="module")
def plain(bundles, prompts, engine_lib):
    engines = _open(bundles[0], engine_lib)   # the first stage as before (no rollback), the last MTP's default
    try:
        return _plain(engines, prompts, N_GEN + K + 1)
    finally:
        for e in engines:
            e.close()


def test_the_mtp_stage_describes_itself(bundles, engine_lib):
    on, off = bundles
    first, last = _open(on, engine_lib)
    with first, last:
        assert not first.has_mtp and first.n_draft_max == 0
        assert last.has_mtp and last.n_draft_max == 8      # DGR_MTP_MAX_K
        assert last.describe().needs_token_ids               # the MTP context pairs each token with h
        last.open_session("s", 0)
        with pytest.raises(SchemaMismatch, match="token ids"):
            last.forward([Step("s", 0, np.arange(2, dtype=np.int32),
                               boundary=np.zeros((2, 4, last.describe().n_embd), np.float32))])
    with Engine.open(off[1], n_ctx=64, max_sessions=1, lib=engine_lib) as e:
        assert not e.has_mtp and e.n_draft_max == 0


def test_speculative_with_real_drafts_equals_plain(bundles, prompts, plain, engine_lib):
    engines = _open(bundles[0], engine_lib, n_draft_max=K)
    try:
        st = _speculative(engines, prompts)
    finally:
        for e in engines:
            e.close()
    _check_same(st, plain)
    acc = {sid: sum(s["acc"]) for sid, s in st.items()}
    print(f"real MTP drafts (random weights): accepted {acc} of {({s: K * len(v['acc']) for s, v in st.items()})}")


def test_every_rollback_depth_equals_plain_and_keeps_the_mtp_cache_clean(bundles, prompts, plain, engine_lib):
    engines = _open(bundles[0], engine_lib, n_draft_max=K)
    try:
        st = _speculative(engines, prompts, ref=plain)
        for sid, s in st.items():
            assert set(s["acc"]) == {0, 1, 2, 3}, s["acc"]
        _check_same(st, plain)
        # the MTP cache after all those drafts and rollbacks drafts as one fed the committed tokens in one go
        last = engines[-1]
        for sid, s in st.items():
            n = s["n_past"]
            t = s["toks"][len(s["toks"]) - 1]
            after = last.mtp_draft(sid, 0, t, K)
            seq = np.concatenate([prompts[sid], np.array(s["toks"][:-1], np.int32)])
            assert len(seq) == n
            for e in engines:
                e.open_session("fresh", 0)
            r = _chain(engines, [("fresh", 0, seq)], "last")[0]
            assert r.next_token == t
            assert last.mtp_draft("fresh", 0, t, K) == after
            for e in engines:
                e.close_session("fresh", 0)
    finally:
        for e in engines:
            e.close()


def test_rollbacks_a_snapshot_cache_cannot_do_are_cache_misses(bundles, prompts, engine_lib):
    engines = _open(bundles[0], engine_lib, n_draft_max=K)
    try:
        p = prompts["b"]
        for e in engines:
            e.open_session("s", 0)
        r = _chain(engines, [("s", 0, p)], "last")[0]
        r = _chain(engines, [("s", len(p), np.array([r.next_token], np.int32))], "last")[0]
        r = _chain(engines, [("s", len(p) + 1, np.array([r.next_token], np.int32))], "last")[0]
        for e in engines:
            # two positions back reaches before the last (one-row) step
            with pytest.raises(CacheMiss, match="before its last step"):
                e.truncate("s", 0, len(p))
            e.truncate("s", 0, len(p) + 1)
            with pytest.raises(CacheMiss, match="already rolled back"):
                e.truncate("s", 0, len(p))
        r = _chain(engines, [("s", len(p) + 1, np.array(list(range(5)), np.int32))], "all")[0]
        for e in engines:
            with pytest.raises(CacheMiss, match="more than the n_draft_max"):
                e.truncate("s", 0, len(p) + 2)
        with pytest.raises(EngineError, match="n_draft_max = 3"):
            engines[-1].mtp_draft("s", 0, 1, K + 1)
    finally:
        for e in engines:
            e.close()


def test_a_stage_without_mtp_refuses_to_draft_naming_include_mtp(bundles, engine_lib):
    on, off = bundles
    for path in (on[0], off[1]):
        with Engine.open(path, n_ctx=64, max_sessions=1, lib=engine_lib) as e:
            e.open_session("s", 0)
            with pytest.raises(EngineError, match=r"bundle\.include_mtp = true"):
                e.mtp_draft("s", 0, 1, 2)


def test_a_stage_marked_mtp_without_the_block_is_refused_before_llama_cpp_loads_it(bundles, engine_lib, tmp_path):
    on, off = bundles
    lacking = rewrite_gguf(off[1], tmp_path / "no-block.gguf", set_kv={"dgr.mtp": True})
    with pytest.raises(EngineError, match=r"dgr\.mtp is set but the file lacks .*bundle\.include_mtp = true"):
        Engine.open(lacking, n_ctx=64, max_sessions=1, lib=engine_lib)
    first = rewrite_gguf(on[0], tmp_path / "first.gguf", set_kv={"dgr.mtp": True})
    with pytest.raises(EngineError, match="not the last"):
        Engine.open(first, n_ctx=64, max_sessions=1, lib=engine_lib)
