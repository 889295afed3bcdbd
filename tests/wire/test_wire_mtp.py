"""MTP drafts on the ring (issue 22, docs/deepseek4.md section 4): the last stage of an include_mtp bundle
drafts k tokens with the MTP block after each draw and returns them with the token; the origin sends token +
drafts as one step; every stage computes them, the last stage accepts the longest matching prefix and every
stage (and the MTP context) rolls back the rest. Through real dgr-worker processes on the real engine:

- greedy text and every logit with `--speculate mtp` equal the same route without it, at 2, 3 and 4 stages
  and in the 12-stage V4-shaped scenario, in one epoch: a stage that had not rolled back the rejected
  drafts would answer the next step CACHE_MISS and the client would re-prefill (a second epoch);
- sampled requests give the same tokens as without drafts (each position's draw is keyed by seed and
  position, a draft is accepted only where it equals that draw);
- a route whose last stage has no MTP block refuses `--speculate mtp` by name.
"""

from __future__ import annotations

import numpy as np
import pytest

from dgr.app.local import LocalRoute
from dgr.core.errors import WireError
from dgr.runtime.wire.client import RouteClient
from dgr.runtime.wire.stats import draft_stats, rings
from dgr.toolchain.bundle import build
from dgr.toolchain.synth.deepseek4 import synth_deepseek4

from support.engine import b3

pytestmark = pytest.mark.engine

LAYERS = 6          # + the MTP block (blk.6); hash-routed layers 0-2 (alpha's tiny V4)
N_CTX = 256
MAX_NEW = 20


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    return synth_deepseek4(tmp_path_factory.mktemp("v4") / "v4.gguf", layers=LAYERS, hash_layers=3, embd=128)


def _bundle(src, ranges, root, mtp=True):
    root.mkdir(parents=True, exist_ok=True)
    pairs = ", ".join(f"[{a}, {b}]" for a, b in ranges)
    r = root / "recipe.toml"
    r.write_text(f'name = "v4wire"\n\n[source]\nuri = "{src}"\nblake3 = "{b3(src)}"\n\n'
                 f"[placement]\nstages = [{pairs}]\n\n[bundle]\ninclude_mtp = {'true' if mtp else 'false'}\n")
    return build(r, root / "store")


def _route(b, engine_lib, extra=()):
    args = [["--bundle", str(b.root), "--stage", str(i), "--threads", "1", "--n-ctx", str(N_CTX), *extra]
            for i in range(len(b.manifest.stages))]
    return LocalRoute(args, env={"DGR_ENGINE_LIB": str(engine_lib)}, timeout=300)


def _prompt(n=40, seed=3):
    return np.random.default_rng(seed).integers(1, 256, size=n).tolist()


def _same(a, b, n_prompt):
    assert a.token_ids == b.token_ids
    rows = range(n_prompt - 1, n_prompt - 1 + len(a.token_ids))
    worst = max(float(np.max(np.abs(a.logits[p] - b.logits[p]))) for p in rows)
    assert all(np.array_equal(a.logits[p], b.logits[p]) for p in rows), f"max |logit diff| {worst}"


@pytest.mark.parametrize("ranges", [[(0, 3), (3, 6)], [(0, 2), (2, 4), (4, 6)], [(0, 1), (1, 3), (3, 5), (5, 6)]],
                         ids=["2-stages", "3-stages", "4-stages"])
def test_mtp_greedy_equals_plain_greedy_and_every_stage_rolls_back(v4, ranges, tmp_path, engine_lib):
    b = _bundle(v4, ranges, tmp_path)
    prompt = _prompt()
    with _route(b, engine_lib) as r, RouteClient(r.addresses, chunk_tokens=16) as c:
        descs = c.describe()
        assert [d.has_mtp for d in descs] == [False] * (len(ranges) - 1) + [True]
        assert all(d.can_roll_back and d.n_draft_max == 8 for d in descs)
        plain = c.run(prompt, max_new_tokens=MAX_NEW, logits="last", stop_token_ids=[])
        spec = c.run(prompt, max_new_tokens=MAX_NEW, logits="last", stop_token_ids=[], speculate="mtp", draft_k=4)
    _same(spec, plain, len(prompt))
    drafted, accepted = draft_stats(spec)
    # random weights: the MTP block rarely agrees with the trunk, so drafts were sent and rejected, and every
    # stage dropped them before the next step (one epoch: no CACHE_MISS, no re-prefill)
    assert drafted >= 4 and accepted < drafted, (drafted, accepted)
    assert spec.epochs == 1 and plain.epochs == 1
    assert rings(spec) <= MAX_NEW


def test_sampled_mtp_keeps_the_sampled_tokens(v4, tmp_path, engine_lib):
    """Sampled requests keep the sampling distribution exactly: the last stage draws each position as a
    plain decode would (keyed by seed and position) and accepts a draft only where it equals that draw,
    so the tokens are those of the run without drafts."""
    b = _bundle(v4, [(0, 3), (3, 6)], tmp_path)
    prompt = _prompt(seed=9)
    kw = dict(max_new_tokens=MAX_NEW, stop_token_ids=[], temperature=0.8, top_k=40, seed=1234)
    with _route(b, engine_lib) as r, RouteClient(r.addresses) as c:
        plain = c.run(prompt, **kw)
        spec = c.run(prompt, speculate="mtp", draft_k=3, **kw)
    assert spec.token_ids == plain.token_ids and spec.epochs == 1
    assert draft_stats(spec)[0] > 0


def test_a_route_without_mtp_refuses_it_by_name(v4, tmp_path, engine_lib):
    b = _bundle(v4, [(0, 3), (3, 6)], tmp_path, mtp=False)
    with _route(b, engine_lib) as r, RouteClient(r.addresses) as c:
        assert not c.describe()[-1].has_mtp
        with pytest.raises(WireError, match=r"--speculate mtp: the last stage .* has no MTP block.*include_mtp"):
            c.run(_prompt(), max_new_tokens=4, speculate="mtp")
        # --draft-max 0 would leave V4 unable to roll back: speculation refused by name, not a cache miss
    with _route(b, engine_lib, ["--draft-max", "0"]) as r, RouteClient(r.addresses) as c:
        assert not any(d.can_roll_back for d in c.describe())
        with pytest.raises(WireError, match="cannot roll back rejected drafts.*--draft-max 0"):
            c.run(_prompt(), max_new_tokens=4, speculate="ngram")


def test_the_default_rollback_depth_is_the_engines_mtp_depth():
    import re

    from dgr.core.paths import REPO_ROOT
    from dgr.runtime.wire.limits import Limits

    header = (REPO_ROOT / "worker/engine/dgr_engine.h").read_text()
    [depth] = re.findall(r"#define DGR_MTP_MAX_K (\d+)", header)
    server = (REPO_ROOT / "worker/server/serve.h").read_text()
    assert Limits().draft_max == int(depth) and "draft_max = DGR_MTP_MAX_K;" in server


def test_twelve_stages_with_mtp_equal_the_plain_route(tmp_path, engine_lib):
    """The 12-stage V4-shaped scenario (43 layers + MTP) with the MTP block on its last stage."""
    from dgr.app.certify import load_contract
    from dgr.app.certify.fixtures import synth_recipe

    [s] = [s for s in load_contract().contract.gate.synthetic if s.name == "deepseek4-v4shape-12stage"]
    b = build(synth_recipe(s, tmp_path, include_mtp=True), tmp_path / "store")
    assert len(b.manifest.stages) == 12 and not b.manifest.excluded_tensors
    prompt = _prompt(n=150, seed=5)                  # past the 128-token compression
    with _route(b, engine_lib) as r, RouteClient(r.addresses, chunk_tokens=64) as c:
        assert c.describe()[-1].has_mtp
        plain = c.run(prompt, max_new_tokens=8, logits="last", stop_token_ids=[])
        spec = c.run(prompt, max_new_tokens=8, logits="last", stop_token_ids=[], speculate="mtp", draft_k=3)
    _same(spec, plain, len(prompt))
    assert spec.epochs == 1 and draft_stats(spec)[0] > 0


def test_the_gateway_speculates_by_default_or_by_request_with_the_same_text(v4, tmp_path, engine_lib):
    """`dgr serve --speculate mtp` (the app's default) and a request's own `speculate` field, through the
    official openai client: the same text as without drafts; the last stage drafted (its metrics say so); a
    route without MTP, or a JSON schema beside an explicit source, is a 400 naming `speculate`."""
    import openai

    from support.gateway import gateway
    from support.metrics import metrics_urls, scrape, value

    b = _bundle(v4, [(0, 3), (3, 6)], tmp_path)
    drafted = lambda url: value(scrape(url), "dgr_worker_mtp_drafts_total")   # noqa: E731
    with _route(b, engine_lib, ["--metrics-listen", "127.0.0.1:0"]) as r:
        url = metrics_urls(r)[-1]
        with gateway(r.route, {"speculate": "mtp", "draft_k": 3},
                     chat_template="{% for m in messages %}{{ m.content }}{% endfor %}") as gw:
            c = gw.client()
            model = c.models.list().data[0].id
            kw = dict(model=model, prompt="the quick brown fox", max_tokens=16, temperature=0)
            before = drafted(url)
            by_default = c.completions.create(**kw).choices[0].text
            assert drafted(url) > before
            before = drafted(url)
            plain = c.completions.create(**kw, extra_body={"speculate": "none"}).choices[0].text
            assert drafted(url) == before
            asked = c.completions.create(**kw, extra_body={"speculate": "mtp", "draft_k": 2}).choices[0].text
            assert by_default == plain == asked and plain
            with pytest.raises(openai.BadRequestError, match="speculate") as e:
                c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          extra_body={"speculate": "mtp"},
                                          response_format={"type": "json_object"})
            assert e.value.body["param"] == "speculate"
    plain_b = _bundle(v4, [(0, 3), (3, 6)], tmp_path / "plain", mtp=False)
    with _route(plain_b, engine_lib) as r:
        with gateway(r.route) as gw:
            c = gw.client()
            with pytest.raises(openai.BadRequestError, match="no MTP block"):
                c.completions.create(model=c.models.list().data[0].id, prompt="hi", max_tokens=4,
                                     extra_body={"speculate": "mtp"})
        with pytest.raises(ValueError, match="--speculate mtp: the last stage has no MTP block"):
            with gateway(r.route, {"speculate": "mtp"}):
                pass


def test_kill_9_of_the_last_stage_mid_draft_with_a_replica_gives_the_same_text(v4, tmp_path, engine_lib):
    """The last stage's first worker SIGKILLs itself about to compute a drafted position (inside the first
    speculative step, by construction); the client re-prefills on the replica, which drafts again."""
    b = _bundle(v4, [(0, 3), (3, 6)], tmp_path)
    prompt = _prompt(seed=4)
    die = ["--test-die-at", f"victim:1:{len(prompt) + 1}"]          # position P+1: the first draft
    args = [["--bundle", str(b.root), "--stage", str(i), "--threads", "1", "--n-ctx", str(N_CTX)] for i in range(2)]
    with LocalRoute(args, env={"DGR_ENGINE_LIB": str(engine_lib)}, timeout=300, replicas=[1, 2],
                    extra=lambda i, k: die if (i, k) == (1, 0) else []) as r, RouteClient(r.replicas) as c:
        want = c.run(prompt, max_new_tokens=MAX_NEW, stop_token_ids=[])
        got = c.run(prompt, max_new_tokens=MAX_NEW, stop_token_ids=[], speculate="mtp", session_id="victim")
        assert r.workers[1][0].proc.wait(30) == -9
    assert got.token_ids == want.token_ids
    assert got.epochs == 2 and got.failures[0].stage == 1 and got.failures[0].address == r.replicas[1][0]
    assert got.routes[-1].split(",")[1] == r.replicas[1][1] and draft_stats(got)[0] > 0


@pytest.mark.parametrize("arch", ["qwen35", "lfm2", "nemotron_h"])
def test_other_snapshot_hybrids_speculate_exactly(arch, tmp_path, engine_lib):
    """The other architectures llama.cpp rolls back through snapshots also roll back with --draft-max: n-gram
    drafts over two worker processes give the plain text and logits, in one epoch."""
    from dgr.toolchain.synth.generic import layer_kinds
    from dgr.toolchain.synth.parity import choose_ranges, model_layers, synth_model

    from support.engine import make_bundle

    layers = model_layers(arch)
    whole = synth_model(arch, tmp_path / f"{arch}.gguf", layers=layers)
    b = make_bundle(whole, choose_ranges(layer_kinds(arch, layers), 2), tmp_path)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8] * 4                          # repeats: n-gram drafts find matches
    with _route(b, engine_lib) as r, RouteClient(r.addresses) as c:
        assert all(d.can_roll_back and d.n_draft_max == 8 for d in c.describe())
        plain = c.run(prompt, max_new_tokens=64, logits="last", stop_token_ids=[])
        spec = c.run(prompt, max_new_tokens=64, logits="last", stop_token_ids=[], speculate="ngram")
    _same(spec, plain, len(prompt))
    assert spec.epochs == 1 and draft_stats(spec)[0] > 0, draft_stats(spec)
