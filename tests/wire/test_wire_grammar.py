"""Structured output and log-probabilities on the last stage (issue 23): llama.cpp's grammar sampler and its
JSON-schema-to-grammar inside dgr-worker, across real worker processes serving SmolLM2 split in two.

The baseline is independent of the route: the whole model in this process, masked by the engine's own
grammar sampler and drawn by the one sampler, token by token. The route must draw the same tokens, its text
must be JSON the schema accepts (checked by `jsonschema`), and a stage killed mid-object must not change a
token (the new epoch's grammar replays what was generated).
"""

from __future__ import annotations

import json
import math

import jsonschema
import numpy as np
import pytest

from dgr.app.local import LocalRoute
from dgr.core.errors import WireError
from dgr.runtime.engine_api import Step
from dgr.runtime.wire.client import RouteClient
from dgr.runtime.wire.errors import StageError
from dgr.runtime.wire.gen import stage_pb2 as pb
from dgr.runtime.wire.limits import MAX_TOP_LOGPROBS

from support.route import die_at

pytestmark = [pytest.mark.engine, pytest.mark.slow]

PROMPT = "<|im_start|>user\nDescribe a person as JSON.<|im_end|>\n<|im_start|>assistant\n"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
                   "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 2}},
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}
SAMPLED = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "seed": 7}
MAX_NEW = 64


@pytest.fixture(scope="module")
def whole(engine_lib, smollm2_gguf):
    from dgr.runtime.engine import Engine

    eng = Engine.open(smollm2_gguf, lib=engine_lib, n_threads=1)
    try:
        yield eng
    finally:
        eng.close()


def replay(eng, ids, *, json_schema="", grammar="", max_new=MAX_NEW, top=0, **sampling):
    """What the route must produce: the whole model, the grammar's mask, the one sampler at each position."""
    from dgr.runtime import engine as E
    g = eng.grammar(gbnf=grammar, json_schema=json_schema) if (grammar or json_schema) else None
    stop = set(eng.vocab().eog)
    sid = f"replay-{id(ids)}-{len(ids)}"
    eng.open_session(sid, 1)
    out, lps, pos, toks = [], [], 0, list(ids)
    try:
        while len(out) < max_new:
            r = eng.forward([Step(session_id=sid, epoch=1, positions=np.arange(pos, pos + len(toks), dtype=np.int32),
                                  token_ids=np.array(toks, dtype=np.int32), want_logits="last")])[0]
            pos += len(toks)
            raw = r.logits[-1]
            row = g.apply(raw) if g else raw
            t = E.sample(row, position=pos - 1, lib=eng._lib, **sampling)
            lps.append(E.logprobs(raw, chosen=t, top=top, lib=eng._lib))
            out.append(t)
            if t in stop:
                break
            if g:
                g.accept(t)
            toks = [t]
    finally:
        eng.close_session(sid, 1)
    return out, lps


def _without_stop(eng, gen) -> str:
    """The generation's text without the end-of-generation token that closed it (the grammar allows it
    only once the structure is complete)."""
    assert gen.token_ids[-1] in eng.vocab().eog, "the grammar completed and the model stopped"
    return gen.text.removesuffix(eng.detokenize(gen.token_ids[-1:]))


def _route(engine_lib, stages=2, replicas=1, extra=None):
    from dgr.app.demo import ensure_bundle

    b = ensure_bundle(stages, progress=False)[0]
    return LocalRoute([["--bundle", str(b.root), "--stage", str(i), "--threads", "1", "--n-ctx", "512"]
                       for i in range(stages)], env={"DGR_ENGINE_LIB": str(engine_lib)}, timeout=300,
                      replicas=replicas, extra=extra)


@pytest.fixture(scope="module")
def route(engine_lib):
    with _route(engine_lib) as r:
        yield r


def test_json_schema_output_is_valid_json_and_the_draws_equal_the_whole_model_under_its_grammar(route, whole):
    ids = whole.tokenize(PROMPT)
    want, _ = replay(whole, ids, json_schema=json.dumps(SCHEMA), **SAMPLED)
    with RouteClient(route.addresses) as c:
        gen = c.run(ids, max_new_tokens=MAX_NEW, json_schema=json.dumps(SCHEMA), **SAMPLED)
    assert gen.token_ids == want
    jsonschema.validate(json.loads(_without_stop(whole, gen)), SCHEMA)
    # without the grammar the same draws are not JSON of that shape: the grammar did the work
    with RouteClient(route.addresses) as c:
        free = c.run(ids, max_new_tokens=MAX_NEW, **SAMPLED)
    assert free.token_ids != gen.token_ids


def test_a_gbnf_grammar_constrains_every_draw(route, whole):
    gbnf = 'root ::= ("yes" | "no") " because " [a-z ]{1,30} "."'
    ids = whole.tokenize("<|im_start|>user\nIs the sky blue?<|im_end|>\n<|im_start|>assistant\n")
    with RouteClient(route.addresses) as c:
        gen = c.run(ids, max_new_tokens=48, grammar=gbnf, temperature=0.7, seed=3)
    want, _ = replay(whole, ids, grammar=gbnf, max_new=48, temperature=0.7, seed=3)
    assert gen.token_ids == want
    head, _, rest = _without_stop(whole, gen).partition(" because ")
    assert head in ("yes", "no") and rest.endswith(".") and set(rest[:-1]) <= set("abcdefghijklmnopqrstuvwxyz ")


def test_logprobs_are_the_whole_models_log_softmax_with_the_top_alternatives(route, whole):
    ids = whole.tokenize("The three primary colors are")
    with RouteClient(route.addresses) as c:
        events = list(c.generate(ids, max_new_tokens=8, stop_token_ids=[], top_logprobs=5, logits="last"))
    _, want = replay(whole, ids, max_new=8, top=5)
    for ev, (lp, top) in zip(events, want, strict=True):
        assert ev.logprob == lp and ev.top_logprobs == top
        # the same numbers as a log-softmax of the row the token was drawn from
        row = ev.logits.astype(np.float64)
        ref = row - (row.max() + math.log(np.exp(row - row.max()).sum()))
        assert abs(ref[ev.token_id] - ev.logprob) < 1e-4
        assert [t for t, _ in ev.top_logprobs] == sorted(range(len(row)), key=lambda i: (-row[i], i))[:5]
    with RouteClient(route.addresses) as c:                   # logprobs alone: the token's own, no alternatives
        ev = next(iter(c.generate(ids, max_new_tokens=1, logprobs=True)))
    assert ev.logprob == want[0][0] and ev.top_logprobs == []
    with RouteClient(route.addresses) as c:                   # not asked: none
        ev = next(iter(c.generate(ids, max_new_tokens=1)))
    assert ev.logprob is None


@pytest.mark.parametrize("at", [3, 11])
def test_a_last_stage_killed_mid_object_resumes_the_same_json(engine_lib, whole, at):
    ids = whole.tokenize(PROMPT)
    want, _ = replay(whole, ids, json_schema=json.dumps(SCHEMA), **SAMPLED)
    assert len(want) > at + 2, "the object must still be open when the stage dies"
    extra = lambda stage, k: die_at("victim", len(ids), at) if (stage, k) == (1, 0) else []  # noqa: E731
    with _route(engine_lib, replicas=[1, 2], extra=extra) as r, RouteClient(r.replicas) as c:
        gen = c.run(ids, max_new_tokens=MAX_NEW, json_schema=json.dumps(SCHEMA), session_id="victim", **SAMPLED)
        assert r.workers[1][0].proc.wait(timeout=30) == -9
    assert gen.epochs == 2, gen.failures
    assert gen.token_ids == want
    jsonschema.validate(json.loads(_without_stop(whole, gen)), SCHEMA)


def _open(c: RouteClient, sid: str, **sampling):
    return c.open(sid, 1, pb.Sampling(**sampling), pb.LOGITS_NONE)


def test_what_the_last_stage_cannot_do_is_refused_naming_the_field(route, whole):
    with RouteClient(route.addresses) as c:
        with pytest.raises(StageError, match="grammar: llama.cpp's grammar parser refused it"):
            _open(c, "bad-gbnf", grammar="root ::= undefined-rule")
        with pytest.raises(StageError, match="json_schema is not JSON"):
            _open(c, "bad-schema", json_schema="{not json")
        with pytest.raises(StageError, match="sampling.grammar and sampling.json_schema are both set"):
            _open(c, "both", grammar='root ::= "a"', json_schema="{}")
        # a re-prefill's tokens that the grammar does not allow: refused, nothing opened
        with pytest.raises(StageError, match=r"sampling.grammar_accepted\[0\]: token .* does not follow the grammar"):
            _open(c, "bad-accepted", grammar='root ::= "yes"', grammar_accepted=whole.tokenize("no", False))
        # the worker's bound is the client's (one constant each side, held equal here)
        _open(c, "top-ok", top_logprobs=MAX_TOP_LOGPROBS)
        c.close_session("top-ok", 1)
        with pytest.raises(StageError, match=f"sampling.top_logprobs is {MAX_TOP_LOGPROBS + 1}, at most "
                                             f"{MAX_TOP_LOGPROBS}"):
            _open(c, "top-over", top_logprobs=MAX_TOP_LOGPROBS + 1)
        with pytest.raises(WireError, match="speculative decoding with a grammar"):
            c.run(whole.tokenize("hi"), max_new_tokens=2, grammar='root ::= "a"', speculate="ngram")
        assert c.run(whole.tokenize("hi"), max_new_tokens=4, stop_token_ids=[]).token_ids   # still serving


def test_the_fake_engine_has_no_vocabulary_to_constrain():
    from support.route import fake_route

    with fake_route() as r, RouteClient(r.addresses) as c:
        with pytest.raises(StageError, match="sampling.grammar: .* has no grammar sampler"):
            _open(c, "fake", grammar='root ::= "a"')
