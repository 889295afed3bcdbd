"""Structured output, tool calls, log-probabilities and prefix-cache usage through the gateway (issue 23),
driven by the official `openai` client over the embedded SmolLM2 split 2 ways in real worker processes.

JSON answers are checked with a JSON Schema validator (`jsonschema`), tool calls' arguments against their
tool's parameters; logprobs are compared number for number with what the route itself reports for the same
prompt (`RouteClient.generate(logprobs=True, top_logprobs=n)`); `cached_tokens` is the prompt the stages
restored from their prefix caches on a repeated request, whose text must not change.
"""

from __future__ import annotations

import json
import uuid

import jsonschema
import openai
import pytest

from dgr.runtime.wire.limits import MAX_TOP_LOGPROBS
from dgr.runtime.wire.prefix import PREFIX_BLOCK_TOKENS

from support.gateway import (gw, rc, rendered, smollm2_route,  # noqa: F401  (gw, rc: module fixtures over `route`)
                             wait_no_sessions)

pytestmark = [pytest.mark.engine]

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
       "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}}]
PARAMS = {"get_weather": WEATHER, "add": ADD}
WEATHER_Q = [{"role": "user", "content": "What is the weather like in Paris?"}]
# a conversation that called a tool and got its result, as OpenAI clients send it
HISTORY = [*WEATHER_Q,
           {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
               "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature": 21, "sky": "sunny"})},
           {"role": "assistant", "content": "It is sunny and 21 degrees in Paris."},
           {"role": "user", "content": "What is the weather like in Rome?"}]


@pytest.fixture(scope="module")
def route(engine_lib):
    with smollm2_route(engine_lib, 2, n_ctx=1024) as r:
        yield r


def _create(gw, **kw):
    return gw.client().chat.completions.create(model=gw.backend.info.name, temperature=0, **kw)


def _chunks(gw, **kw) -> list:
    return list(_create(gw, stream=True, **kw))


# ---------------------------------------------------------------------------------------------- response_format
@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_answers_follow_the_schema(gw, rc, stream):
    msgs = [{"role": "user", "content": "Describe a person as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    if stream:
        chunks = _chunks(gw, messages=msgs, response_format=fmt, max_tokens=48)
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        out = _create(gw, messages=msgs, response_format=fmt, max_tokens=48)
        text, finish = out.choices[0].message.content, out.choices[0].finish_reason
    jsonschema.validate(json.loads(text), PERSON)
    assert finish == "stop"
    # the route's own run under the same schema draws the same tokens
    ref = rc.run(rendered(gw, msgs), max_new_tokens=48, json_schema=json.dumps(PERSON))
    eos = set(rc.hops[-1].eos_token_ids)
    assert text == "".join(e.text for e in ref.events if e.token_id not in eos)


def test_json_object_answers_are_objects(gw):
    out = _create(gw, messages=[{"role": "user", "content": "Answer in JSON: what is the capital of France?"}],
                  response_format={"type": "json_object"}, max_tokens=40)
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    assert out.choices[0].finish_reason == "stop"


def test_responses_text_format_follows_the_schema(gw):
    out = gw.client().responses.create(
        model=gw.backend.info.name, input="Describe a person as JSON.", max_output_tokens=48, temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}})
    assert out.status == "completed" and out.text.format.type == "json_schema"
    jsonschema.validate(json.loads(out.output_text), PERSON)
    obj = gw.client().responses.create(model=gw.backend.info.name, max_output_tokens=40, temperature=0,
                                       input="Answer in JSON: what is the capital of France?",
                                       text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(obj.output_text), dict)


# ---------------------------------------------------------------------------------------------- tools
def _call(choice) -> tuple[str, dict]:
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, PARAMS[call.function.name])
    return call.function.name, args


def test_tool_choice_required_and_named_give_a_parsed_call(gw):
    name, args = _call(_create(gw, messages=WEATHER_Q, tools=TOOLS, tool_choice="required", max_tokens=40).choices[0])
    assert name in PARAMS
    # a named tool: that one, whatever the question
    named = {"type": "function", "function": {"name": "add"}}
    name, args = _call(_create(gw, messages=WEATHER_Q, tools=TOOLS, tool_choice=named, max_tokens=40).choices[0])
    assert name == "add" and set(args) == {"a", "b"}


def test_a_streamed_tool_call_is_one_delta(gw):
    want = _call(_create(gw, messages=WEATHER_Q, tools=TOOLS, tool_choice="required", max_tokens=40).choices[0])
    chunks = _chunks(gw, messages=WEATHER_Q, tools=TOOLS, tool_choice="required", max_tokens=40)
    assert chunks[0].choices[0].delta.role == "assistant"
    calls = [tc for ch in chunks for tc in ch.choices[0].delta.tool_calls or []]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].id.startswith("call_")
    assert (calls[0].function.name, json.loads(calls[0].function.arguments)) == want
    assert not any(ch.choices[0].delta.content for ch in chunks)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices[0].finish_reason] == ["tool_calls"]
    # the client's stream helper accumulates it into the final message
    with gw.client().chat.completions.stream(model=gw.backend.info.name, messages=WEATHER_Q, tools=TOOLS,
                                             tool_choice="required", max_tokens=40, temperature=0) as s:
        final = s.get_final_completion()
    assert _call(final.choices[0]) == want


@pytest.mark.parametrize("stream", [False, True])
def test_auto_after_a_tool_history_parses_the_models_call(gw, stream):
    """The history (an assistant's call, the tool's result) renders through a template that knows no tools;
    the model, free to answer anything, answers with a call, which becomes tool_calls."""
    if stream:
        chunks = _chunks(gw, messages=HISTORY, tools=TOOLS, max_tokens=40)
        [call] = [tc for ch in chunks for tc in ch.choices[0].delta.tool_calls or []]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        name, args = call.function.name, json.loads(call.function.arguments)
    else:
        name, args = _call(_create(gw, messages=HISTORY, tools=TOOLS, max_tokens=40).choices[0])
    assert name == "get_weather" and args["city"] == "Rome"
    jsonschema.validate(args, WEATHER)
    # tool_choice none: no tools in play, the answer is text
    out = _create(gw, messages=HISTORY, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content


# ---------------------------------------------------------------------------------------------- logprobs
def _route_logprobs(rc, prompt, n, max_new):
    """What the route reports for the same prompt: per printed token (its text, logprob, top n)."""
    gen = rc.run(prompt, max_new_tokens=max_new, logprobs=True, top_logprobs=n)
    eos = set(rc.hops[-1].eos_token_ids)
    text = lambda i: rc.detokenize([i])                                       # noqa: E731
    return [(text(e.token_id), e.logprob, [(text(t), lp) for t, lp in e.top_logprobs])
            for e in gen.events if e.token_id not in eos]


def _check_order(entries):
    """Top entries most likely first; the chosen token no likelier than the likeliest."""
    for _, lp, top in entries:
        lps = [x for _, x in top]
        assert lps == sorted(lps, reverse=True)
        assert lp <= lps[0]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_are_the_routes(gw, rc, stream):
    msgs = [{"role": "user", "content": "Name a color."}]
    n, max_tokens = 5, 6
    want = _route_logprobs(rc, rendered(gw, msgs), n, max_tokens)
    if stream:
        chunks = _chunks(gw, messages=msgs, max_tokens=max_tokens, logprobs=True, top_logprobs=n)
        content = [e for ch in chunks if ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    else:
        out = _create(gw, messages=msgs, max_tokens=max_tokens, logprobs=True, top_logprobs=n)
        content, text = out.choices[0].logprobs.content, out.choices[0].message.content
    got = [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in content]
    assert got == want and len(got) > 0
    assert all(len(top) == n for _, _, top in got)
    assert all(e.bytes == list(e.token.encode()) for e in content)
    assert "".join(e.token for e in content) == text
    _check_order(got)
    # logprobs without top_logprobs: the chosen tokens only
    out = _create(gw, messages=msgs, max_tokens=max_tokens, logprobs=True)
    assert [(e.token, e.logprob) for e in out.choices[0].logprobs.content] == [w[:2] for w in want]
    assert all(e.top_logprobs == [] for e in out.choices[0].logprobs.content)
    assert _create(gw, messages=msgs, max_tokens=2).choices[0].logprobs is None


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_are_the_routes(gw, rc, stream):
    prompt, n, max_tokens = "The three primary colors are", 3, 6
    want = _route_logprobs(rc, prompt, n, max_tokens)
    kw = dict(model=gw.backend.info.name, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=n)
    if stream:
        chunks = list(gw.client().completions.create(stream=True, **kw))
        parts = [ch.choices[0].logprobs for ch in chunks if ch.choices[0].logprobs]
        lp = {k: [x for p in parts for x in getattr(p, k)] for k in
              ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        text = "".join(ch.choices[0].text for ch in chunks)
    else:
        out = gw.client().completions.create(**kw)
        lp, text = out.choices[0].logprobs.model_dump(), out.choices[0].text
    assert lp["tokens"] == [w[0] for w in want] and lp["token_logprobs"] == [w[1] for w in want]
    # the top `n` and the chosen token (OpenAI: up to logprobs + 1)
    assert lp["top_logprobs"] == [{**dict(w[2]), w[0]: w[1]} for w in want]
    # where each token starts, counted from the start of the prompt
    assert lp["text_offset"] == [len(prompt) + len("".join(lp["tokens"][:i])) for i in range(len(want))]
    assert "".join(lp["tokens"]) == text
    _check_order(want)


def test_responses_logprobs_equal_chats(gw):
    c, model = gw.client(), gw.backend.info.name
    msgs = [{"role": "user", "content": "Name a color."}]
    ref = _create(gw, messages=msgs, max_tokens=6, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    want = [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in ref]
    out = c.responses.create(model=model, input="Name a color.", max_output_tokens=6, temperature=0, top_logprobs=2,
                             include=["message.output_text.logprobs"])
    got = [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
           for e in out.output[0].content[0].logprobs]
    assert got == want and out.top_logprobs == 2
    events = list(c.responses.create(model=model, input="Name a color.", max_output_tokens=6, temperature=0,
                                     top_logprobs=2, include=["message.output_text.logprobs"], stream=True))
    deltas = [(e.token, e.logprob) for ev in events if ev.type == "response.output_text.delta" for e in ev.logprobs]
    assert deltas == [w[:2] for w in want]


# ---------------------------------------------------------------------------------------------- cached_tokens
def test_a_repeated_prompt_is_restored_from_the_prefix_cache(gw):
    # a system message no earlier request sent (so the first is cold), well over two cache blocks
    system = f"Session {uuid.uuid4().hex}. " + "You are a careful assistant who answers in one short sentence. " * 8
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "What is the capital of France?"}]
    first = _create(gw, messages=msgs, max_tokens=12)
    assert first.usage.prompt_tokens > 2 * PREFIX_BLOCK_TOKENS
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = _create(gw, messages=msgs, max_tokens=12)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens and cached % PREFIX_BLOCK_TOKENS == 0
    assert second.choices[0].message.content == first.choices[0].message.content
    # streamed usage and the Responses API say the same
    chunks = _chunks(gw, messages=msgs, max_tokens=12, stream_options={"include_usage": True})
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    out = gw.client().responses.create(model=gw.backend.info.name, instructions=system, max_output_tokens=12,
                                       input="What is the capital of France?", temperature=0)
    assert out.usage.input_tokens_details.cached_tokens == cached
    assert out.output_text == first.choices[0].message.content


def test_cache_prompt_false_neither_restores_nor_keeps_the_prefix(gw):
    """llama-server's per-request opt-out: the stages prefill the whole prompt and keep nothing of it."""
    system = f"Session {uuid.uuid4().hex}. " + "You are a careful assistant who answers in one short sentence. " * 8
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "What is the capital of Spain?"}]
    off = {"cache_prompt": False}
    first = _create(gw, messages=msgs, max_tokens=12, extra_body=off)
    again = _create(gw, messages=msgs, max_tokens=12, extra_body=off)        # nothing was kept: cold again
    assert first.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens_details.cached_tokens == 0
    warm_on = _create(gw, messages=msgs, max_tokens=12)                      # the first that keeps it
    assert warm_on.usage.prompt_tokens_details.cached_tokens == 0
    assert _create(gw, messages=msgs, max_tokens=12, extra_body=off).usage.prompt_tokens_details.cached_tokens == 0
    assert _create(gw, messages=msgs, max_tokens=12).usage.prompt_tokens_details.cached_tokens > 0
    assert first.choices[0].message.content == again.choices[0].message.content == warm_on.choices[0].message.content
    out = gw.client().responses.create(model=gw.backend.info.name, instructions=system, max_output_tokens=12,
                                       input="What is the capital of Spain?", temperature=0, extra_body=off)
    assert out.usage.input_tokens_details.cached_tokens == 0


# ---------------------------------------------------------------------------------------------- refusals
def _refused(call, **kw) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        call(**kw)
    assert e.value.status_code == 400
    return e.value.body


def test_what_cannot_be_done_is_400_naming_the_field(gw, route):
    c, model = gw.client(), gw.backend.info.name
    msgs = [{"role": "user", "content": "hi"}]
    chat_, done = c.chat.completions.create, dict(model=model, messages=msgs, max_tokens=2)
    # a schema llama.cpp's json_schema_to_grammar refuses
    bad = {"type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}
    body = _refused(chat_, **done, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": bad}})
    assert (body["param"], body["code"]) == ("response_format", "invalid_schema") and "missing" in body["message"]
    body = _refused(chat_, **done, tool_choice="required", tools=[
        {"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}])
    assert (body["param"], body["code"]) == ("tools", "invalid_schema") and "frob" in body["message"]
    body = _refused(c.responses.create, model=model, input="hi", max_output_tokens=2,
                    text={"format": {"type": "json_schema", "name": "x", "schema": bad}})
    assert body["param"] == "text.format"
    assert wait_no_sessions(route.addresses) == [0, 0]             # the refused sessions closed on every stage
    # top_logprobs over the route's bound, on chat, completions and responses
    body = _refused(chat_, **done, logprobs=True, top_logprobs=MAX_TOP_LOGPROBS + 1)
    assert body["param"] == "top_logprobs" and str(MAX_TOP_LOGPROBS) in body["message"]
    assert _refused(c.completions.create, model=model, prompt="hi", max_tokens=2,
                    logprobs=MAX_TOP_LOGPROBS + 1)["param"] == "logprobs"
    assert _refused(c.responses.create, model=model, input="hi", max_output_tokens=2,
                    top_logprobs=MAX_TOP_LOGPROBS + 1)["param"] == "top_logprobs"
    # combinations
    assert _refused(chat_, **done, top_logprobs=2)["param"] == "top_logprobs"            # without logprobs
    assert _refused(chat_, **done, tool_choice="required")["param"] == "tool_choice"     # without tools
    assert _refused(chat_, **done, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}
                    )["param"] == "tool_choice"
    assert _refused(chat_, **done, response_format={"type": "json_object"},
                    extra_body={"ignore_eos": True})["param"] == "ignore_eos"
    assert _refused(chat_, **done, response_format={"type": "json_schema"})["param"] == "response_format"
    assert _refused(chat_, **done, tools=[TOOLS[0], TOOLS[0]])["param"] == "tools"
    body = _refused(c.responses.create, model=model, input="hi", max_output_tokens=2,
                    include=["reasoning.encrypted_content"])
    assert (body["param"], body["code"]) == ("include", "unsupported_parameter")
