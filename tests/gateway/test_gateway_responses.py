"""The gateway's OpenAI fidelity beyond plain chat, driven by the official `openai` client over the embedded
SmolLM2 split 3 ways in real worker processes: the Responses API (`/v1/responses`, streaming and not, and its
cancel), `n` choices with `seed`, and fields it does not support answered by name. Every text is checked
against what the route itself gives for the same rendered prompt and sampling (`RouteClient.run`). A route
of fake-engine workers (about 2 ms a token) shows a Responses client that leaves, and a stage that dies
mid-stream."""

from __future__ import annotations

import openai
import pytest
import requests

from dgr.app.gateway.limits import MAX_CHOICES

from support.gateway import (gateway, gw, metric, open_sessions,  # noqa: F401  (gw, rc: module fixtures over `route`)
                             rc, rendered, smollm2_route, wait_no_sessions)
from support.route import fake_route

pytestmark = [pytest.mark.engine]

QUESTION = "What is the capital of France? Answer in one sentence."
INSTRUCTIONS = "You are a geography teacher."
MAX = 32
N_CTX = 2048                # room for a generation that runs long enough to be cancelled mid-way
STREAM_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
                 "response.content_part.added"]


@pytest.fixture(scope="module")
def route(engine_lib):
    with smollm2_route(engine_lib, 3, n_ctx=N_CTX) as r:
        yield r


def _ref(gw, rc, messages, **kw):
    """The route's own run of the rendered messages: (printed text, generation, ended at a stop token)."""
    kw.setdefault("max_new_tokens", MAX)
    gen = rc.run(rendered(gw, messages), **kw)
    eos = set(rc.hops[-1].eos_token_ids)
    return "".join(e.text for e in gen.events if e.token_id not in eos), gen, gen.token_ids[-1] in eos


def _chat_messages():
    return [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]


# ---------------------------------------------------------------------------------------------- /v1/responses
@pytest.mark.parametrize("stream", [False, True])
def test_a_response_equals_the_route_and_the_chat_completion(gw, rc, stream):
    text, ref, stopped = _ref(gw, rc, _chat_messages())
    assert stopped and text.strip(), "SmolLM2 answers this within MAX tokens at temperature 0"
    c, model = gw.client(), gw.backend.info.name
    # input as a list of messages with input_text parts; instructions become the system message
    kw = dict(model=model, instructions=INSTRUCTIONS, max_output_tokens=MAX, temperature=0,
              input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION[:20]},
                                                  {"type": "input_text", "text": QUESTION[20:]}]}])
    if stream:
        events = list(c.responses.create(stream=True, **kw))
        types = [e.type for e in events]
        n_deltas = len(types) - len(STREAM_EVENTS) - 4
        assert types == [*STREAM_EVENTS, *["response.output_text.delta"] * n_deltas, "response.output_text.done",
                         "response.content_part.done", "response.output_item.done", "response.completed"]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[0].response.status == "in_progress" and events[0].response.output == []
        rid = events[0].response.id
        assert all(getattr(e, "response", None) is None or e.response.id == rid for e in events)
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
        assert events[-4].text == text and events[-2].item.content[0].text == text
        out = events[-1].response
    else:
        out = c.responses.create(**kw)
    assert out.object == "response" and out.status == "completed" and out.incomplete_details is None
    assert out.output_text == text and out.output[0].role == "assistant" and out.output[0].status == "completed"
    assert out.usage.input_tokens == len(ref.prompt_ids) and out.usage.output_tokens == len(ref.token_ids)
    assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens
    assert out.store is False and out.instructions == INSTRUCTIONS
    same = c.chat.completions.create(model=model, messages=_chat_messages(), max_tokens=MAX, temperature=0)
    assert same.choices[0].message.content == text


def test_the_stream_helper_and_a_string_input_that_runs_out_of_tokens(gw, rc):
    c, model = gw.client(), gw.backend.info.name
    user = [{"role": "user", "content": QUESTION}]
    text, ref, stopped = _ref(gw, rc, user)
    assert stopped
    with c.responses.stream(model=model, input=QUESTION, max_output_tokens=MAX, temperature=0) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert "".join(deltas) == final.output_text == text and final.usage.output_tokens == len(ref.token_ids)
    # three tokens of budget: incomplete, and says why (the stream ends in response.incomplete)
    short, _, _ = _ref(gw, rc, user, max_new_tokens=3)
    out = c.responses.create(model=model, input=QUESTION, max_output_tokens=3, temperature=0)
    assert (out.status, out.incomplete_details.reason, out.output_text) == ("incomplete", "max_output_tokens", short)
    assert out.usage.output_tokens == 3 and out.output[0].status == "incomplete"
    events = list(c.responses.create(model=model, input=QUESTION, max_output_tokens=3, temperature=0, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == short


def test_responses_refuse_what_they_do_not_do_by_name(gw):
    c, model = gw.client(), gw.backend.info.name
    refused = {
        "tools": dict(tools=[{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}]),
        "previous_response_id": dict(previous_response_id="resp_123"),
        "store": dict(store=True),
        "background": dict(background=True),
        "reasoning": dict(reasoning={"effort": "high"}),
        "truncation": dict(truncation="auto"),
    }
    for param, kw in refused.items():
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(model=model, input="hi", max_output_tokens=2, **kw)
        assert (e.value.body["param"], e.value.body["code"]) == (param, "unsupported_parameter"), param
        assert param in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model=model, max_output_tokens=2, input=[{"role": "user", "content": [
            {"type": "input_text", "text": "what is this?"}, {"type": "input_image", "image_url": "x"}]}])
    assert e.value.body["param"] == "input[0].content[1]" and "input_image" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model=model, input="hi", max_output_tokens=2, extra_body={"bogus": 1})
    assert (e.value.body["param"], e.value.body["code"]) == ("bogus", "unknown_parameter")
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model=model, input="hi", max_output_tokens=N_CTX)
    assert (e.value.body["param"], e.value.body["code"]) == ("max_output_tokens", "context_length_exceeded")


def test_cancel_frees_every_stage_at_once(gw, route):
    c, model = gw.client(), gw.backend.info.name
    before = requests.get(gw.url + "/metrics").text
    budget = N_CTX - 64                  # half a minute of tokens or more: still running when it is cancelled
    s = c.responses.create(model=model, input="Tell me a long story.", max_output_tokens=budget, temperature=0,
                           stream=True, extra_body={"ignore_eos": True})
    events = iter(s)
    rid = next(events).response.id
    assert next(e for e in events if e.type == "response.output_text.delta").delta
    assert open_sessions(route.addresses) == [1, 1, 1]
    out = c.responses.cancel(rid)                  # answers once the session is closed on every stage
    assert open_sessions(route.addresses) == [0, 0, 0]
    assert out.id == rid and out.status == "cancelled" and 0 < out.usage.output_tokens < budget
    rest = list(events)                           # the stream ends: its response says it was cancelled
    assert rest[-1].type == "response.incomplete" and rest[-1].response.status == "cancelled"
    assert rest[-1].response.output_text == out.output_text
    with pytest.raises(openai.NotFoundError) as e:  # it has ended: nothing to cancel any more
        c.responses.cancel(rid)
    assert e.value.body["code"] == "response_not_found"
    after = requests.get(gw.url + "/metrics").text
    assert metric(after, "dgr_gateway_cancelled_total") - metric(before, "dgr_gateway_cancelled_total") == 1
    assert metric(after, "dgr_gateway_open_streams") == 0
    assert metric(after, "dgr_gateway_requests_total", endpoint="/v1/responses/{id}/cancel", status="200") >= 1


# ---------------------------------------------------------------------------------------------- n and seed
def test_n_choices_at_temperature_0_are_identical(gw, rc):
    c, model = gw.client(), gw.backend.info.name
    text, ref, _ = _ref(gw, rc, _chat_messages(), max_new_tokens=8)
    out = c.chat.completions.create(model=model, messages=_chat_messages(), n=3, max_tokens=8, temperature=0)
    assert [ch.index for ch in out.choices] == [0, 1, 2]
    assert [ch.message.content for ch in out.choices] == [text] * 3
    assert out.usage.prompt_tokens == len(ref.prompt_ids) and out.usage.completion_tokens == 3 * len(ref.token_ids)
    chunks = list(c.completions.create(model=model, prompt=rendered(gw, _chat_messages()), n=2, max_tokens=8,
                                       temperature=0, stream=True))
    by_index = {i: "".join(ch.choices[0].text for ch in chunks if ch.choices[0].index == i) for i in (0, 1)}
    assert by_index == {0: text, 1: text}
    assert sorted(ch.choices[0].index for ch in chunks if ch.choices[0].finish_reason) == [0, 1]


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_with_a_seed_are_the_routes_draws_for_seed_plus_i(gw, rc, stream):
    c, model = gw.client(), gw.backend.info.name
    user = [{"role": "user", "content": "Name a color."}]
    seed, n = 1234, 3
    # what the route samples for seeds seed+i (the gateway's top_p 1 is the wire's 0: off)
    want = [_ref(gw, rc, user, max_new_tokens=10, temperature=1.0, top_p=0.0, seed=seed + i)[0] for i in range(n)]
    assert len(set(want)) > 1, "different seeds draw different texts"
    kw = dict(model=model, messages=user, n=n, max_tokens=10, temperature=1.0, seed=seed)
    for _ in range(2):                                           # and the same again: reproducible
        if stream:
            chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
            got = ["".join(ch.choices[0].delta.content or "" for ch in chunks
                           if ch.choices and ch.choices[0].index == i) for i in range(n)]
            roles = [ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].delta.role]
            assert roles == list(range(n)) and chunks[-1].choices == []
        else:
            got = [ch.message.content for ch in c.chat.completions.create(**kw).choices]
        assert got == want
    # choice 0 is what n=1 gives for the same seed
    one = c.chat.completions.create(model=model, messages=user, max_tokens=10, temperature=1.0, seed=seed)
    assert one.choices[0].message.content == want[0]


def test_n_over_the_bound_and_unsupported_fields_are_400_naming_the_field(gw):
    c, model = gw.client(), gw.backend.info.name
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=model, messages=msgs, n=MAX_CHOICES + 1, max_tokens=2)
    assert e.value.body["param"] == "n" and str(MAX_CHOICES) in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=model, prompt="hi", n=MAX_CHOICES + 1, max_tokens=2)
    assert e.value.body["param"] == "n"
    for param, kw in {"frequency_penalty": dict(frequency_penalty=0.5), "presence_penalty": dict(presence_penalty=1),
                      "logit_bias": dict(logit_bias={"42": 5}), "store": dict(store=True),
                      "reasoning_effort": dict(reasoning_effort="low")}.items():
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=model, messages=msgs, max_tokens=2, **kw)
        assert (e.value.body["param"], e.value.body["code"]) == (param, "unsupported_parameter"), param
    for param, kw in {"echo": dict(echo=True), "best_of": dict(best_of=3), "suffix": dict(suffix="end")}.items():
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=model, prompt="hi", max_tokens=2, **kw)
        assert (e.value.body["param"], e.value.body["code"]) == (param, "unsupported_parameter"), param
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=model, messages=msgs, max_tokens=2, extra_body={"min_p": 0.1})
    assert (e.value.body["param"], e.value.body["code"]) == ("min_p", "unknown_parameter")
    # the neutral values of an unsupported field, and OpenAI's hints, are accepted
    out = c.chat.completions.create(model=model, messages=msgs, max_tokens=2, temperature=0, frequency_penalty=0,
                                    presence_penalty=0.0, store=False, user="u1", metadata={"k": "v"})
    assert out.usage.completion_tokens >= 1


# ---------------------------------------------------------------------------------------------- failures
FAKE_SPEC = "layers=6,embd=16,cuts=2:4,seed=8,ctx=40000"   # room for a generation of a minute or more
FAKE_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"


def test_a_responses_client_that_leaves_or_a_stage_that_dies():
    with fake_route(spec=FAKE_SPEC) as r, gateway(r.route, chat_template=FAKE_TEMPLATE, attempts=1,
                                                  hop_deadline=3.0) as g:
        model, body = g.backend.info.name, {"input": "a long one", "max_output_tokens": 32000, "temperature": 0,
                                            "ignore_eos": True}
        # a non-streaming client that times out: its session closes on every stage
        with pytest.raises(requests.exceptions.ReadTimeout):
            requests.post(g.url + "/v1/responses", json={"model": model, **body}, timeout=0.5)
        assert wait_no_sessions(r.addresses, 10) == [0, 0, 0]
        # a stage that dies mid-stream: an `error` event, then response.failed with the route's message
        s = g.client().responses.create(model=model, stream=True, input=body["input"], temperature=0,
                                        max_output_tokens=body["max_output_tokens"], extra_body={"ignore_eos": True})
        events = iter(s)
        assert next(e for e in events if e.type == "response.output_text.delta")
        r.kill(1)
        rest = list(events)
        assert [e.type for e in rest[-2:]] == ["error", "response.failed"]
        assert "stage 1" in rest[-2].message and rest[-1].response.status == "failed"
        assert rest[-1].response.error.code == "server_error" and "stage 1" in rest[-1].response.error.message
