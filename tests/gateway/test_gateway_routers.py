"""One gateway router at a time: a FastAPI app that includes only that router (and the error handlers), its
state given through the dependency it declares (`app.dependency_overrides[gateway_state]`), over a scripted
route: a stand-in for RouteBackend/RouteClient whose answer is chosen by a word in the prompt and whose
sessions say when they were closed. Nothing else of `create_app` is there (no app.state, no middleware, no
other surface), so what passes here is the router's own doing: SSE framing, stop strings cut across tokens,
usage, a route failing before or during a stream, a client that goes away, and a response cancelled by id.

The stand-in keeps the route client's contract (test_the_stand_in_keeps_the_route_clients_contract): the same
generate() keywords, at most max_new_tokens tokens, the end-of-generation token after its text, and its
generator closed (the session closed along the route) however the generation ends."""

from __future__ import annotations

import inspect
import json
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import requests
from fastapi import FastAPI

from dgr.app.gateway import errors
from dgr.app.gateway.route import ModelInfo, RouteBackend
from dgr.app.gateway.routes import completions, responses
from dgr.app.gateway.server import GatewayServer
from dgr.app.gateway.state import GatewayState, gateway_state
from dgr.core.errors import WireError
from dgr.runtime.wire.client import RouteClient
from dgr.runtime.wire.stats import TokenEvent

from support.gateway import metric

EOS = 0
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
HELLO = ["Hel", "lo", " wo", "rld"]             # the scripted answer: one token per piece


def _script(prompt: str):
    """What the scripted route answers to `prompt`: its pieces (an exception: the route fails there)."""
    if "fail now" in prompt:
        return [WireError("stage 1 fell over")]
    if "fail later" in prompt:
        return ["Hi", " there", WireError("stage 1 fell over")]
    if "slow" in prompt:
        return None                            # "ab" forever, 10 ms a token
    return HELLO


@dataclass
class _Last:
    cached_tokens: int = 0


class ScriptedClient:
    """RouteClient.generate over a script: one token per piece, then the end-of-generation token."""

    def __init__(self, backend: ScriptedBackend):
        self.backend, self.last = backend, _Last()

    def generate(self, prompt, *, max_new_tokens: int = 32, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 0.0, seed: int = 0, stop_token_ids: list[int] | None = None,
                 speculate: str | None = None, draft_k: int = 4, json_schema: str = "", logprobs: bool = False,
                 top_logprobs: int = 0, prefix_cache: bool | None = None):
        b = self.backend
        script = _script(b.detokenize(list(prompt)))
        session = {"tokens": 0, "closed": False}
        b.sessions.append(session)
        self.last = _Last()
        try:
            for n in range(max_new_tokens):
                if script is None:
                    time.sleep(0.01)
                    piece = "ab"
                else:
                    piece = script[n] if n < len(script) else None
                if isinstance(piece, Exception):
                    raise piece
                tid = EOS if piece is None else b.token_id(piece)
                session["tokens"] += 1
                yield TokenEvent(token_id=tid, text=piece or "", position=len(prompt) + n, epoch=1, ring_ns=0,
                                 compute_ns=0, logprob=-0.5 if logprobs else None)
        finally:
            session["closed"] = True


class ScriptedBackend:
    """What the gateway uses of RouteBackend: `info`, `client()`, `tokenize`, `detokenize`, `token_texts`.
    A character is a token of the prompt; a script's piece is one token of the answer. `sessions`: every
    generation, with the tokens it made and whether it was closed."""

    def __init__(self):
        self.info = ModelInfo(name="scripted", bundle_id="f" * 64, n_ctx=4096, eos_ids=(EOS,),
                              chat_template=TEMPLATE, chat_template_source="the test", bos_token="", eos_token="",
                              stages=1, created=0, speculation=(("ngram", "scripted"), ("mtp", "scripted")),
                              numerics=("scripted",))
        self.sessions: list[dict] = []
        self._pieces: dict[str, int] = {}

    def token_id(self, piece: str) -> int:
        return self._pieces.setdefault(piece, 0x110000 + len(self._pieces))

    @contextmanager
    def client(self):
        yield ScriptedClient(self)

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return [ord(ch) for ch in text]

    def detokenize(self, ids: list[int]) -> str:
        texts = {v: k for k, v in self._pieces.items()}
        return "".join(texts.get(i, chr(i) if 0 < i < 0x110000 else "") for i in ids)

    def token_texts(self, c, ids) -> list[str]:
        return [self.detokenize([i]) for i in ids]


@contextmanager
def router_app(router):
    """`router` alone in a FastAPI app, its state given by overriding the dependency, served on loopback."""
    st = GatewayState.of(ScriptedBackend())
    app = FastAPI()
    app.include_router(router)
    errors.install(app, st.metrics)
    app.dependency_overrides[gateway_state] = lambda: st
    server = GatewayServer(app, "127.0.0.1:0").start()
    try:
        yield server.url, st
    finally:
        server.stop()


@pytest.fixture(scope="module")
def chat_app():
    with router_app(completions.router) as served:
        yield served


@pytest.fixture(scope="module")
def responses_app():
    with router_app(responses.router) as served:
        yield served


def _chat(content: str, **kw) -> dict:
    return {"model": "scripted", "messages": [{"role": "user", "content": content}], **kw}


def _events(text: str) -> list[str]:
    """The SSE events of a whole stream body; every event ends with a blank line."""
    assert text.endswith("\n\n"), text[-200:]
    return text[:-2].split("\n\n")


def _data(events: list[str]) -> list:
    out = []
    for ev in events:
        assert ev.startswith("data: ") and "\n" not in ev, ev
        out.append(ev[len("data: "):] if ev == "data: [DONE]" else json.loads(ev[len("data: "):]))
    return out


def _closed(st: GatewayState, timeout: float = 10.0) -> list[dict]:
    """Every session the route opened, once each has been closed (or `timeout`)."""
    deadline = time.monotonic() + timeout
    while not all(s["closed"] for s in st.backend.sessions) and time.monotonic() < deadline:
        time.sleep(0.02)
    return st.backend.sessions


def test_the_stand_in_keeps_the_route_clients_contract():
    real = inspect.signature(RouteClient.generate).parameters
    mine = inspect.signature(ScriptedClient.generate).parameters
    assert set(mine) <= set(real), set(mine) - set(real)
    assert all(real[k].kind == p.kind for k, p in mine.items())
    assert {"client", "tokenize", "detokenize", "token_texts"} <= set(dir(RouteBackend))
    b = ScriptedBackend()
    assert isinstance(b.info, ModelInfo)
    with b.client() as c:
        it = c.generate(b.tokenize("hi"), max_new_tokens=3)
        assert [(e.token_id != EOS, e.text) for e in it] == [(True, "Hel"), (True, "lo"), (True, " wo")]
        assert [e.text for e in c.generate(b.tokenize("hi"), max_new_tokens=9)] == [*HELLO, "", "", "", "", ""]
        it = c.generate(b.tokenize("fail later"), max_new_tokens=9)
        assert next(it).text == "Hi" and next(it).text == " there"
        with pytest.raises(WireError):
            next(it)
    assert [s["closed"] for s in b.sessions] == [True, True, True]
    assert b.detokenize([b.token_id("lo")]) == "lo" and b.tokenize("ab") == [97, 98]


def test_the_chat_router_alone_answers_whole_and_streamed(chat_app):
    url, st = chat_app
    r = requests.post(url + "/v1/chat/completions", json=_chat("hello", temperature=0))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == "scripted"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello world"}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len(HELLO) + 1        # the end-of-generation token is sampled too
    assert body["usage"]["prompt_tokens"] == len("<user>hello\n<assistant>")

    r = requests.post(url + "/v1/chat/completions", json=_chat("hello", stream=True,
                                                                stream_options={"include_usage": True}))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["cache-control"] == "no-cache"
    chunks = _data(_events(r.text))
    assert chunks[-1] == "[DONE]"
    first, *pieces, finish, usage, _ = chunks
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"]["content"] for c in pieces) == "Hello world"
    assert finish["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(HELLO) + 1
    assert len({c["id"] for c in chunks[:-1]}) == 1
    assert all(s["closed"] for s in _closed(st))


def test_a_stop_string_across_tokens_is_cut_and_never_sent(chat_app):
    url, st = chat_app
    before = len(st.backend.sessions)
    # "lo w" spans the tokens "lo" and " wo": the text before it is sent, nothing of it, then finish "stop"
    r = requests.post(url + "/v1/chat/completions", json=_chat("hello", stream=True, stop=["lo w"], max_tokens=50))
    chunks = _data(_events(r.text))
    texts = [c["choices"][0]["delta"].get("content") for c in chunks[1:-2]]
    assert "".join(texts) == "Hel" and not any("lo" in t for t in texts), texts
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and chunks[-1] == "[DONE]"
    session = _closed(st)[before]
    assert session["closed"] and session["tokens"] == 3              # stopped at " wo", the session closed
    # not streamed: the same cut
    r = requests.post(url + "/v1/completions", json={"model": "scripted", "prompt": "hello", "stop": "rld"})
    assert r.json()["choices"][0]["text"] == "Hello wo" and r.json()["choices"][0]["finish_reason"] == "stop"


def _metric(st: GatewayState, name: str, **labels) -> float:
    return metric(st.metrics.render().decode(), name, **labels)


def test_errors_answer_in_openai_shape_before_and_during_a_stream(chat_app):
    url, st = chat_app
    before = _metric(st, "dgr_gateway_errors_total", code="route_error")
    for r, status, code in (
            (requests.post(url + "/v1/chat/completions", data=b"{no"), 400, "invalid_json"),
            (requests.post(url + "/v1/chat/completions", json={**_chat("x"), "model": "other"}), 404, "model_not_found"),
            (requests.post(url + "/v1/chat/completions", json=_chat("x", bogus=1)), 400, "unknown_parameter"),
            (requests.get(url + "/v1/chat/completions"), 405, "method_not_allowed"),
            (requests.get(url + "/v1/models"), 404, "unknown_url"),             # not this router's
            # a route that fails before the first piece: an HTTP status, streamed or not
            (requests.post(url + "/v1/chat/completions", json=_chat("fail now")), 502, "route_error"),
            (requests.post(url + "/v1/chat/completions", json=_chat("fail now", stream=True)), 502, "route_error")):
        assert r.status_code == status, r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"} and r.json()["error"]["code"] == code
    # after the stream started: one error event, then [DONE] (no finish, no usage)
    r = requests.post(url + "/v1/chat/completions", json=_chat("fail later", stream=True,
                                                                stream_options={"include_usage": True}))
    assert r.status_code == 200
    chunks = _data(_events(r.text))
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:3]] == ["Hi", " there"]
    assert chunks[3]["error"]["code"] == "route_error" and "stage 1 fell over" in chunks[3]["error"]["message"]
    assert chunks[4:] == ["[DONE]"]
    assert _metric(st, "dgr_gateway_errors_total", code="route_error") - before == 3
    assert _metric(st, "dgr_gateway_open_streams") == 0


def test_a_client_that_goes_away_closes_its_session(chat_app):
    url, st = chat_app
    before, gone = len(st.backend.sessions), _metric(st, "dgr_gateway_client_gone_total")
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps(_chat("slow", stream=True)).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    got = b""
    while got.count(b"data: ") < 3:                             # the role, then text flowing
        more = sock.recv(4096)
        assert more, got
        got += more
    assert b" 200 " in got and b'"content": "ab"' in got
    sock.close()
    session = _closed(st)[before]
    assert session["closed"] and session["tokens"] < 1000, session      # long before the budget (2048)
    assert _metric(st, "dgr_gateway_client_gone_total") - gone == 1
    assert _metric(st, "dgr_gateway_open_streams") == 0


def _typed(events: list[str]) -> list[dict]:
    out = []
    for ev in events:
        head, data = ev.split("\n")
        obj = json.loads(data.removeprefix("data: "))
        assert head == f"event: {obj['type']}", ev
        out.append(obj)
    return out


def test_the_responses_router_alone_streams_fails_and_cancels(responses_app):
    url, st = responses_app
    r = requests.post(url + "/v1/responses", json={"model": "scripted", "input": "hello", "stream": True})
    events = _typed(_events(r.text))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:4]] == ["response.created", "response.in_progress",
                                               "response.output_item.added", "response.content_part.added"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Hello world"
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["status"] == "completed"
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "Hello world"
    assert "[DONE]" not in r.text

    r = requests.post(url + "/v1/responses", json={"model": "scripted", "input": "fail later", "stream": True})
    events = _typed(_events(r.text))
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "Hi there"

    # cancelled by id while it streams: the answer says cancelled, the stream ends incomplete, the session closed
    before = len(st.backend.sessions)
    with requests.post(url + "/v1/responses", json={"model": "scripted", "input": "slow", "stream": True},
                       stream=True) as s:
        lines = s.iter_lines(decode_unicode=True)
        created = json.loads(next(x for x in lines if x.startswith("data: "))[len("data: "):])
        rid = created["response"]["id"]
        assert list(st.live) == [rid]
        answer: dict = {}
        t = threading.Thread(target=lambda: answer.update(requests.post(f"{url}/v1/responses/{rid}/cancel").json()))
        t.start()
        rest = "\n".join(lines)
        t.join(30)
    assert answer["status"] == "cancelled" and answer["id"] == rid
    assert '"type": "response.incomplete"' in rest and '"status": "cancelled"' in rest
    assert _closed(st)[before]["closed"] and st.live == {}
    r = requests.post(f"{url}/v1/responses/{rid}/cancel")
    assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"
