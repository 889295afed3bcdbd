"""A gateway that lets go: a request whose client has gone (timed out, closed, reset) frees every stage
while tokens flow as fast as the route makes them, streaming or not; a chat request without max_tokens
is bounded by the server's default (`dgr serve --max-tokens-default`); and the gateway says where its chat
template came from. Over a route of fake-engine worker processes (about 2 ms a token), driven by the
official `openai` client and by raw sockets.

Each generation asks for BUDGET tokens, which the route needs a minute or more to make: a gateway that
did not notice the client leave would hold the sessions for that long and generate them all. Nothing
here asserts a speed: every wait polls up to a generous deadline."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import time

import openai
import pytest
import requests

from dgr.app.gateway.limits import DEFAULT_CHAT_MAX_TOKENS

from support.gateway import gateway, metric, open_sessions, serve_process, wait_no_sessions
from support.route import fake_route

SPEC = "layers=6,embd=16,cuts=2:4,seed=8,ctx=40000"
BUDGET = 32000                       # tokens a generation asks for: far more than a client here waits for
DEADLINE = 60.0                      # seconds to wait for every stage to let go (the bound is well under 1 s)
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
MESSAGES = [{"role": "user", "content": "tell me everything"}]
# Sampled, so that nearly every token is one of the fake vocabulary's bytes and prints text: the greedy
# choice can settle on a token that prints nothing, and a gateway that only looks for a gone client after
# 0.5 s without text (as it once did) would notice by luck.
FLOWING = dict(temperature=1.0, seed=5, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def route():
    with fake_route(spec=SPEC) as r:
        yield r


@pytest.fixture(scope="module")
def gw(route):
    with gateway(route.route, chat_template=TEMPLATE) as g:
        yield g


def _wait_sessions(addresses, want: list[int]) -> list[int]:
    """Poll every stage's open sessions until they are `want` (or DEADLINE); the last counts seen."""
    deadline = time.monotonic() + DEADLINE
    while True:
        counts = open_sessions(addresses)
        if counts == want or time.monotonic() > deadline:
            return counts
        time.sleep(0.05)


def _counters(g) -> tuple[float, float]:
    text = requests.get(g.url + "/metrics").text
    return metric(text, "dgr_gateway_generated_tokens_total"), metric(text, "dgr_gateway_client_gone_total")


def _let_go(g, route, before) -> None:
    """Every stage frees the session, the generation stopped long before its budget, the gateway knew why."""
    assert wait_no_sessions(route.addresses, DEADLINE) == [0, 0, 0]
    tokens, gone = _counters(g)
    assert 0 < tokens - before[0] < BUDGET                 # it ran, and stopped when the client left
    assert gone - before[1] == 1
    text = requests.get(g.url + "/metrics").text
    assert metric(text, "dgr_gateway_active_generations") == 0 and metric(text, "dgr_gateway_open_streams") == 0


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_client_that_times_out_on_a_non_streaming_request_frees_every_stage(gw, route, kind):
    # what the operator saw: a non-streaming chat whose client gave up, tokens flowing all the while
    c = gw.client().with_options(timeout=1.0)
    before = _counters(gw)
    with pytest.raises(openai.APITimeoutError):
        if kind == "chat":
            c.chat.completions.create(model=gw.backend.info.name, messages=MESSAGES, max_tokens=BUDGET, **FLOWING)
        else:
            c.completions.create(model=gw.backend.info.name, prompt="once upon a time", max_tokens=BUDGET, **FLOWING)
    _let_go(gw, route, before)


def test_a_client_that_closes_a_fast_stream_frees_every_stage(gw, route):
    c = gw.client()
    before = _counters(gw)
    s = c.chat.completions.create(model=gw.backend.info.name, messages=MESSAGES, max_tokens=BUDGET, stream=True,
                                  **FLOWING)
    it = iter(s)
    for _ in range(20):
        next(it)
    assert open_sessions(route.addresses) == [1, 1, 1]
    s.close()
    _let_go(gw, route, before)


def test_four_open_streams_hold_four_sessions_and_closing_them_frees_every_one(gw, route):
    c = gw.client()
    before = _counters(gw)
    streams = [c.completions.create(model=gw.backend.info.name, prompt=p, max_tokens=BUDGET, stream=True, **FLOWING)
               for p in ("one", "two two", "three three three", "four")]
    for s in streams:
        next(iter(s))
    assert open_sessions(route.addresses) == [4, 4, 4]
    for s in streams:
        s.close()
    assert wait_no_sessions(route.addresses, DEADLINE) == [0, 0, 0]
    tokens, gone = _counters(gw)
    assert 0 < tokens - before[0] < 4 * BUDGET              # each stopped long before its budget
    assert gone - before[1] == 4
    text = requests.get(gw.url + "/metrics").text
    assert metric(text, "dgr_gateway_active_generations") == 0 and metric(text, "dgr_gateway_open_streams") == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_connection_reset_frees_every_stage(gw, route, stream):
    """A client whose connection is reset (RST, no FIN) after the request went out."""
    before = _counters(gw)
    host, port = gw.server.address.rsplit(":", 1)
    body = json.dumps({"model": gw.backend.info.name, "prompt": "a reset", "max_tokens": BUDGET, "temperature": 1.0,
                       "seed": 5, "ignore_eos": True, "stream": stream}).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    if stream:
        assert b" 200 " in sock.recv(64)                        # the stream started: tokens are flowing
    else:                                                        # the generation is running
        assert _wait_sessions(route.addresses, [1, 1, 1]) == [1, 1, 1]
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()                                                 # linger 0: the kernel sends RST
    _let_go(gw, route, before)


def test_a_chat_without_max_tokens_stops_at_the_servers_default(route):
    with gateway(route.route, {"max_tokens_default": 9}, chat_template=TEMPLATE) as g:
        c = g.client()
        out = c.chat.completions.create(model=g.backend.info.name, messages=MESSAGES, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 9 and out.choices[0].finish_reason == "length"
        # the request's own bound wins, under either of OpenAI's names
        out = c.chat.completions.create(model=g.backend.info.name, messages=MESSAGES, temperature=0, max_tokens=12,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 12
        out = c.chat.completions.create(model=g.backend.info.name, messages=MESSAGES, temperature=0,
                                        max_completion_tokens=4, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 4
        # /v1/completions keeps OpenAI's own default of 16
        out = c.completions.create(model=g.backend.info.name, prompt="x", temperature=0,
                                   extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 16
        assert requests.get(g.url + "/health").json()["max_tokens_default"] == 9
    with gateway(route.route, chat_template=TEMPLATE) as g:
        assert requests.get(g.url + "/health").json()["max_tokens_default"] == DEFAULT_CHAT_MAX_TOKENS
    assert 256 <= DEFAULT_CHAT_MAX_TOKENS <= 8192            # bounded, yet room for any ordinary answer


def test_dgr_serve_bounds_chat_and_says_where_its_chat_template_came_from(route, tmp_path):
    f = tmp_path / "template.jinja"
    f.write_text(TEMPLATE)
    with serve_process(route.route, "--chat-template", str(f), "--max-tokens-default", "5") as (proc, url):
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = c.models.list().data[0].id
        out = c.chat.completions.create(model=model, messages=MESSAGES, temperature=0, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"
        health = requests.get(url + "/health").json()
        log = "".join(proc.output)
    assert f"chat template from --chat-template {f.resolve()}" in log, log
    assert "its own chat template" not in log
    assert health["chat_template"] == f"--chat-template {f.resolve()}" and health["max_tokens_default"] == 5
    with serve_process(route.route) as (proc, url):                  # the fake model has no template
        health = requests.get(url + "/health").json()
        log = "".join(proc.output)
    assert "no chat template" in log and "--chat-template FILE" in log, log
    assert health["chat_template"] == "none" and health["max_tokens_default"] == DEFAULT_CHAT_MAX_TOKENS
    # a bad value or an empty template file: refused at start, saying what to give instead
    f.write_text("")
    for args, why in ((["--max-tokens-default", "-1"], "--max-tokens-default -1"),
                      (["--chat-template", str(f)], "is empty")):
        p = subprocess.run([sys.executable, "-m", "dgr", "serve", "--route", route.route, "--listen", "127.0.0.1:0",
                            *args], capture_output=True, text=True, timeout=120)
        assert p.returncode != 0 and why in p.stderr, p.stderr
