"""The gateway while stage 0 of its route is down, stopped or restarting, over fake-engine worker processes and
the gateway served for real (uvicorn on loopback). A user trial found it answering a raw 500 with a gRPC dump
(the prompt's Tokenize at stage 0 raised an unmapped grpc error) and then closing the connection under the
client's next request (`openai.APIConnectionError`). Every generating endpoint, streaming or not, must answer
503 `hop_unreachable` with a Retry-After header, a stream that breaks when stage 0 dies must end with the same
error object in the stream, nothing of Python or gRPC may show in a body, and once stage 0 is back the
gateway answers again."""

from __future__ import annotations

import json

import openai
import pytest
import requests

from support.gateway import gateway, metric
from support.route import fake_route

SPEC = "layers=6,embd=16,cuts=2:4,seed=8,ctx=40000"     # room for a stream far longer than a kill takes to land
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
HOP_DEADLINE = 3.0      # probes of the live stages get 3 s to answer on a loaded machine
LONG_BUDGET = 32000     # tokens: a minute or more of the route's time, never done before a fault lands
MESSAGES = [{"role": "user", "content": "hi"}]
ENDPOINTS = {"/v1/completions": {"prompt": "x", "max_tokens": 4},
             "/v1/chat/completions": {"messages": MESSAGES, "max_tokens": 4},
             "/v1/responses": {"input": "hi", "max_output_tokens": 4}}
# what a body must never show: a traceback, a gRPC error's repr or its details
LEAKS = ("Traceback", "_InactiveRpcError", "debug_error_string", "StatusCode", "grpc", "failed to connect",
         "UNAVAILABLE", "DEADLINE_EXCEEDED")


def _clean(text: str) -> None:
    assert not [s for s in LEAKS if s in text], text


def _refused(resp: requests.Response) -> dict:
    """A 503 hop_unreachable naming stage 0, with a Retry-After, in OpenAI's shape."""
    assert resp.status_code == 503, resp.text
    assert int(resp.headers["Retry-After"]) >= 1
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert (err["type"], err["code"]) == ("server_error", "hop_unreachable") and "stage 0" in err["message"]
    _clean(resp.text)
    return err


def _ask_every_endpoint(g, http: requests.Session) -> list[requests.Response]:
    """Every generating endpoint, not streaming then streaming, over one keep-alive connection."""
    model = g.backend.info.name
    return [http.post(g.url + path, json={"model": model, "stream": stream, **body}, timeout=120)
            for path, body in ENDPOINTS.items() for stream in (False, True)]


def _calls(c: openai.OpenAI, model: str):
    """(name, call(stream)) of every generating endpoint through the official client, 4 tokens whatever they are
    (greedy, no stop at the eos); a stream is read to its end."""
    kw = {"temperature": 0, "extra_body": {"ignore_eos": True}}

    def read(out, stream):
        return list(out) if stream else out
    return [("completions", lambda s: read(c.completions.create(model=model, prompt="x", max_tokens=4, stream=s,
                                                                **kw), s)),
            ("chat", lambda s: read(c.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, stream=s,
                                                              **kw), s)),
            ("responses", lambda s: read(c.responses.create(model=model, input="hi", max_output_tokens=4, stream=s,
                                                            **kw), s))]


def _client_refused(c: openai.OpenAI, model: str) -> None:
    for name, call in _calls(c, model):
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as e:      # a stream that cannot start: its status
                call(stream)
            assert e.value.status_code == 503 and e.value.body["code"] == "hop_unreachable", (name, stream)
            assert int(e.value.response.headers["Retry-After"]) >= 1
            _clean(e.value.response.text)


def _answers(c: openai.OpenAI, model: str) -> None:
    """Every generating endpoint runs its 4 tokens, streaming and not."""
    out = {name: (call(False), call(True)) for name, call in _calls(c, model)}
    for name in ("completions", "chat"):
        full, chunks = out[name]
        assert full.usage.completion_tokens == 4 and full.choices[0].finish_reason == "length", name
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length", name
    full, events = out["responses"]
    assert full.usage.output_tokens == 4 and full.status == "incomplete"
    assert events[-1].type == "response.incomplete" and events[-1].response.usage.output_tokens == 4


def test_stage_0_killed_answers_503_hop_unreachable_then_serves_again_once_restarted():
    with fake_route(spec=SPEC) as r, gateway(r.route, chat_template=TEMPLATE, hop_deadline=HOP_DEADLINE) as g, \
            requests.Session() as http:
        model, c = g.backend.info.name, g.client()
        _answers(c, model)
        r.kill(0)
        for resp in _ask_every_endpoint(g, http):
            _refused(resp)
        _client_refused(c, model)       # one keep-alive connection: a refusal never breaks the next request
        text = http.get(g.url + "/metrics").text
        assert metric(text, "dgr_gateway_errors_total", code="hop_unreachable") == 12
        for path in ENDPOINTS:
            assert metric(text, "dgr_gateway_requests_total", endpoint=path, status="503") == 4
        r.restart(0)                    # a new worker on the same port (restarted in place)
        _answers(c, model)
        assert all(resp.status_code == 200 for resp in _ask_every_endpoint(g, http))


def test_stage_0_stopped_answers_503_hop_unreachable_then_serves_again_once_resumed():
    """A stopped worker (SIGSTOP: its sockets open, nothing answers) is refused the same way: the liveness probe
    (the hop deadline) finds it."""
    with fake_route(spec=SPEC) as r, gateway(r.route, chat_template=TEMPLATE, hop_deadline=HOP_DEADLINE) as g, \
            requests.Session() as http:
        model, c = g.backend.info.name, g.client()
        _answers(c, model)
        r.pause(0)
        try:
            for resp in _ask_every_endpoint(g, http):
                _refused(resp)
        finally:
            r.resume(0)
        _answers(c, model)


def _sse_data(resp: requests.Response):
    """The `data:` payloads of a stream, as they arrive."""
    return (line[len("data: "):] for line in resp.iter_lines(decode_unicode=True) if line.startswith("data: "))


def test_stage_0_dying_mid_stream_ends_every_stream_with_the_error():
    """Chat and completions: one `data: {"error": ...}` event (the object a non-streaming request gets), then the
    stream ends; Responses: an `error` event, then response.failed. Stage 0 comes back between the streams."""
    with fake_route(spec=SPEC) as r, gateway(r.route, chat_template=TEMPLATE, attempts=1,
                                             hop_deadline=HOP_DEADLINE) as g:
        model, c = g.backend.info.name, g.client()
        long = {"temperature": 0, "extra_body": {"ignore_eos": True}}
        streams = {"completions": lambda: c.completions.create(model=model, prompt="x", max_tokens=LONG_BUDGET,
                                                               stream=True, **long),
                   "chat": lambda: c.chat.completions.create(model=model, messages=MESSAGES, max_tokens=LONG_BUDGET,
                                                             stream=True, **long)}
        for name, start in streams.items():
            chunks = iter(start())
            next(chunks)
            r.kill(0)
            with pytest.raises(openai.APIError) as e:
                for _ in chunks:
                    pass
            assert e.value.body["code"] == "hop_unreachable" and "stage 0" in e.value.message, name
            _clean(json.dumps(e.value.body))
            r.restart(0)
        events = iter(c.responses.create(model=model, input="hi", max_output_tokens=LONG_BUDGET, stream=True, **long))
        assert next(e for e in events if e.type == "response.output_text.delta")
        r.kill(0)
        rest = list(events)
        assert [e.type for e in rest[-2:]] == ["error", "response.failed"]
        assert rest[-2].code == "hop_unreachable" and "stage 0" in rest[-2].message
        assert rest[-1].response.status == "failed" and "stage 0" in rest[-1].response.error.message
        _clean(rest[-2].model_dump_json() + rest[-1].model_dump_json())
        r.restart(0)
        # the raw stream: the error object a non-streaming request gets, then [DONE]
        with requests.post(g.url + "/v1/chat/completions", stream=True, timeout=120,
                           json={"model": model, "messages": MESSAGES, "max_tokens": LONG_BUDGET, "stream": True,
                                 "temperature": 0, "ignore_eos": True}) as resp:
            assert resp.status_code == 200
            data = _sse_data(resp)
            first = next(data)
            assert "choices" in json.loads(first)
            r.kill(0)
            rest = list(data)
        assert rest[-1] == "[DONE]"
        err = json.loads(rest[-2])
        assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}
        assert err["error"]["code"] == "hop_unreachable" and "stage 0" in err["error"]["message"]
        _clean(rest[-2])
        r.restart(0)
        _answers(c, model)
