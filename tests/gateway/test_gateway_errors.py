"""The gateway's errors in OpenAI's shape, its sandboxed chat templates, concurrent sessions and a route that
dies mid-stream, over a route of fake-engine worker processes (fast); the official `openai` client raises the
matching exception classes."""

from __future__ import annotations

import json
import threading

import openai
import pytest
import requests

from dgr.app.gateway.limits import MAX_CHOICES
from dgr.runtime.wire.client import RouteClient

from support.gateway import gateway, metric, open_sessions
from support.route import fake_route, make_ca, tls_args

SPEC = "layers=6,embd=16,cuts=2:4,seed=8,ctx=2048"
LONG_SPEC = "layers=6,embd=16,cuts=2:4,seed=8,ctx=40000"
LONG_BUDGET = 32000     # tokens: a minute or more of the route's time, never done before a fault lands
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
            "{{ raise_exception('the system message must come first') }}{% endif %}"
            "<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def route():
    with fake_route(spec=SPEC) as r:
        yield r


@pytest.fixture(scope="module")
def gw(route):
    with gateway(route.route, chat_template=TEMPLATE) as g:
        yield g


@pytest.fixture(scope="module")
def bare(route):
    """A gateway over the same route with the model's own (absent) chat template."""
    with gateway(route.route) as g:
        yield g


def _model(g) -> str:
    return g.backend.info.name


def _error(resp: requests.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    return body["error"]


def test_bad_json_and_bad_fields_answer_400_in_openai_shape(gw):
    for raw in (b"{not json", b"\xff\xfe", b"[1, 2]", b""):
        err = _error(requests.post(gw.url + "/v1/chat/completions", data=raw,
                                   headers={"Content-Type": "application/json"}), 400)
        assert err["type"] == "invalid_request_error" and err["code"] == "invalid_json"
    c = gw.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=_model(gw), messages=[])
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=_model(gw), prompt="hi", n=MAX_CHOICES + 1)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=_model(gw), prompt="hi", temperature=5)
    assert e.value.body["param"] == "temperature"
    err = _error(requests.post(gw.url + "/v1/completions", json={"model": _model(gw)}), 400)
    assert err["param"] == "prompt" and err["code"] == "missing_required_parameter"


def test_unknown_model_url_and_method_answer_404_and_405(gw):
    c = gw.client()
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    assert "gpt-4o" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="gpt-4o", prompt="hi")
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4o")
    assert c.models.retrieve(_model(gw)).id == _model(gw)
    assert _error(requests.get(gw.url + "/v1/nothing-here"), 404)["code"] == "unknown_url"
    assert _error(requests.get(gw.url + "/v1/completions"), 405)["code"] == "method_not_allowed"


def test_over_long_prompt_and_n_ctx_exceeded_are_refused_before_anything_runs(gw, route):
    c = gw.client()
    before = requests.get(gw.url + "/metrics").text
    with pytest.raises(openai.BadRequestError) as e:                              # 2101 tokens, n_ctx 2048
        c.completions.create(model=_model(gw), prompt="x" * 2100, max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded" and "2048" in e.value.body["message"]
    assert e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:                              # 1001 + 1100 > 2048
        c.completions.create(model=_model(gw), prompt="x" * 1000, max_tokens=1100)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=_model(gw), messages=[{"role": "user", "content": "y" * 2100}])
    assert e.value.body["code"] == "context_length_exceeded"
    after = requests.get(gw.url + "/metrics").text
    assert metric(after, "dgr_gateway_prompt_tokens_total") == metric(before, "dgr_gateway_prompt_tokens_total")
    assert metric(after, "dgr_gateway_errors_total", code="context_length_exceeded") == \
        metric(before, "dgr_gateway_errors_total", code="context_length_exceeded") + 3
    assert open_sessions(route.addresses) == [0, 0, 0]
    # the whole context is usable: prompt + max_tokens == n_ctx runs
    out = c.completions.create(model=_model(gw), prompt="x" * 2039, max_tokens=8, temperature=0,
                               extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens == 2040 and out.usage.completion_tokens == 8
    assert out.usage.total_tokens == 2048 and out.choices[0].finish_reason == "length"


def test_chat_template_is_sandboxed_and_its_exceptions_are_400(gw, bare, route):
    c = gw.client()
    msgs = [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=_model(gw), messages=msgs, max_tokens=4)
    assert "the system message must come first" in e.value.body["message"]
    # the template renders exactly what the route then runs
    out = c.chat.completions.create(model=_model(gw), messages=[{"role": "user", "content": [
        {"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]}], max_tokens=6, temperature=0)
    with RouteClient(route.addresses) as rc:
        ref = rc.run("<user>hello\n<assistant>", max_new_tokens=6)
    assert out.usage.prompt_tokens == len(ref.prompt_ids)
    assert out.choices[0].message.content == "".join(e.text for e in ref.events if e.token_id not in (2,))
    with pytest.raises(openai.BadRequestError) as e:
        bare.client().chat.completions.create(model=_model(bare), messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "chat_template_missing"
    from dgr.app.gateway import chat

    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(chat.TemplateRefused, match="unsafe|access"):
        chat.render(evil, [{"role": "user", "content": "x"}])
    with pytest.raises(chat.TemplateRefused):
        chat.render("{% set x = messages.append(1) %}", [{"role": "user", "content": "x"}])   # immutable
    assert chat.render("{{ messages|tojson }}", [{"role": "user", "content": "é"}]) == \
        '[{"role": "user", "content": "é"}]'


# a template that renders tools and calls itself (as Hugging Face tool templates do)
TOOLS_TEMPLATE = ("{% if tools %}<tools>{{ tools|tojson }}\n{% endif %}{% for m in messages %}<{{ m['role'] }}>"
                  "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }} {{ c.function.arguments|tojson }}"
                  "{% endfor %}{{ m['content'] }}\n{% endfor %}<assistant>")
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
ARGS = {"city": "Paris"}
TOOL_HISTORY = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "user", "content": "And tomorrow?"}]


def test_tools_and_a_tool_history_render_in_the_template_or_as_text(gw, route):
    """The fake engine's tokenizer is one token per byte (plus the BOS), so `prompt_tokens` is the rendered
    prompt's length: a template that renders tools gets them and the calls (arguments as objects); one that
    does not gets the calls as JSON text and the results as a user message."""
    with gateway(route.route, chat_template=TOOLS_TEMPLATE) as g:
        out = g.client().chat.completions.create(model=_model(g), messages=TOOL_HISTORY, tools=[TOOL], max_tokens=2,
                                                 temperature=0)
    want = (f"<tools>{json.dumps([TOOL])}\n<user>Weather in Paris?\n<assistant><call>get_weather {json.dumps(ARGS)}\n"
            "<tool>sunny\n<user>And tomorrow?\n<assistant>")
    assert out.usage.prompt_tokens == len(want) + 1
    out = gw.client().chat.completions.create(model=_model(gw), messages=TOOL_HISTORY, max_tokens=2, temperature=0)
    call = json.dumps({"name": "get_weather", "arguments": ARGS})
    want = (f"<user>Weather in Paris?\n<assistant>{call}\n"
            "<user>Result of get_weather (call call_1):\nsunny\n\nAnd tomorrow?\n<assistant>")
    assert out.usage.prompt_tokens == len(want) + 1
    # with tools in play, a system message first lists them (TEMPLATE refuses a system message elsewhere)
    with_tools = gw.client().chat.completions.create(model=_model(gw), messages=TOOL_HISTORY, tools=[TOOL],
                                                     max_tokens=2, temperature=0)
    assert with_tools.usage.prompt_tokens > out.usage.prompt_tokens + len(json.dumps(TOOL["function"]["parameters"]))


def test_concurrent_requests_are_concurrent_sessions(gw, route):
    c = gw.client()
    prompts = ["one", "two two", "three three three", "four"]
    refs = []
    with RouteClient(route.addresses) as rc:
        for p in prompts:
            g = rc.run(p, max_new_tokens=24, stop_token_ids=[])
            refs.append(g.text)
    got: dict[int, str] = {}

    def ask(i):
        got[i] = c.completions.create(model=_model(gw), prompt=prompts[i], max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [got.get(i) for i in range(len(prompts))] == refs


def test_a_dead_route_answers_503_and_a_stream_that_breaks_ends_in_an_error_event(tmp_path):
    # a generation far longer than the kill takes to land (the stage dies while it streams); probes of the
    # live stages get 3 s to answer on a loaded machine
    with fake_route(spec=LONG_SPEC) as r, gateway(r.route, attempts=1, hop_deadline=3.0) as g:
        c = g.client()
        model = _model(g)
        s = c.completions.create(model=model, prompt="x", max_tokens=LONG_BUDGET, temperature=0, stream=True,
                                 extra_body={"ignore_eos": True})
        chunks = iter(s)
        next(chunks)
        r.kill(1)
        with pytest.raises(openai.APIError) as e:
            for _ in chunks:
                pass
        assert "stage 1" in str(e.value)
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model=model, prompt="x", max_tokens=4)
        assert e.value.status_code == 503 and e.value.body["code"] == "hop_unreachable"
        assert f"stage 1 ({r.addresses[1]})" in e.value.body["message"]
        with pytest.raises(openai.InternalServerError) as e:        # a stream that cannot start: its status too
            c.completions.create(model=model, prompt="x", max_tokens=4, stream=True)
        assert e.value.status_code == 503
        text = requests.get(g.url + "/metrics").text
        assert metric(text, "dgr_gateway_errors_total", code="hop_unreachable") >= 3
        assert metric(text, "dgr_gateway_requests_total", endpoint="/v1/completions", status="503") == 2
        assert json.loads(requests.get(g.url + "/health").text)["stages"] == 3


def test_a_mutual_tls_route_is_served_with_the_gateways_certificate(tmp_path):
    from dgr.core.errors import WireError
    from dgr.runtime.wire.tls import TlsConfig

    ops = make_ca(tmp_path, "ops", ["w0", "w1", "w2", "gateway"])
    ca = tmp_path / "ops" / "ca.pem"
    with fake_route(spec=SPEC, extra=lambda stage, _rep: tls_args(*ops[f"w{stage}"], ca)) as r:
        with RouteClient(r.addresses, tls=TlsConfig(*ops["gateway"], ca)) as rc:
            want = rc.run("secret", max_new_tokens=12, stop_token_ids=[]).text
        with gateway(r.route, tls=TlsConfig(*ops["gateway"], ca)) as g:
            out = g.client().completions.create(model=_model(g), prompt="secret", max_tokens=12, temperature=0,
                                                extra_body={"ignore_eos": True})
        assert out.choices[0].text == want
        with pytest.raises(WireError, match="TLS"):                 # no certificate: refused at start
            with gateway(r.route, hop_deadline=10.0):      # refused at the handshake, long before that
                pass
