"""The OpenAI-compatible gateway over the embedded SmolLM2 split 3 ways in real worker processes, driven by
the official `openai` client: chat (the model's own template) and completions, streaming and not, equal what
the route client (`dgr generate`) gives for the same prompt; stop strings, usage, n_ctx, a client that
disconnects mid-stream, `/metrics`, and `dgr serve` as a process."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest
import requests

from dgr.app.gateway import chat

from support.gateway import (gw, metric, open_sessions, rc,  # noqa: F401  (gw, rc: module fixtures over `route`)
                             serve_process, smollm2_route, wait_no_sessions)

pytestmark = [pytest.mark.engine, pytest.mark.slow]

MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
PROMPT = "The three primary colors are"
MAX = 24


@pytest.fixture(scope="module")
def route(engine_lib):
    with smollm2_route(engine_lib, 3) as r:
        yield r


def _printed(gen, eos) -> str:
    """What the route generated, without the text of a token-level stop (the gateway never prints it)."""
    return "".join(e.text for e in gen.events if e.token_id not in eos)


def _finish(gen, eos, max_tokens) -> str:
    return "stop" if gen.token_ids and gen.token_ids[-1] in eos else "length"


def test_models_is_the_routes_model(gw, rc):
    [m] = gw.client().models.list().data
    assert m.id == rc.hops[0].identity.model == gw.backend.info.name
    assert gw.backend.info.n_ctx == 512 and gw.backend.info.chat_template == rc.hops[0].chat_template != ""
    assert gw.backend.info.chat_template_source == "the GGUF's tokenizer.chat_template (stage 0)"
    # the stops: the eos (<|im_end|>) first, then every other end-of-generation id (<|endoftext|>, ...)
    assert gw.backend.info.eos_ids == tuple(rc.hops[-1].eos_token_ids) and gw.backend.info.eos_ids[0] == 2
    assert 0 in gw.backend.info.eos_ids and gw.backend.info.eos_token == "<|im_end|>"


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_the_route_for_the_rendered_prompt(gw, rc, stream):
    info = gw.backend.info
    rendered = chat.render(info.chat_template, MESSAGES, special_tokens={"eos_token": info.eos_token})
    assert rendered.startswith("<|im_start|>system\n") and rendered.endswith("<|im_start|>assistant\n")
    ref = rc.run(rendered, max_new_tokens=MAX)                    # what `dgr generate` does
    eos = set(rc.hops[-1].eos_token_ids)
    c = gw.client()
    if stream:
        chunks = list(c.chat.completions.create(model=info.name, messages=MESSAGES, max_tokens=MAX, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        assert len(finish) == 1
        finish, usage = finish[0], chunks[-1].usage
        assert chunks[-1].choices == []
    else:
        out = c.chat.completions.create(model=info.name, messages=MESSAGES, max_tokens=MAX, temperature=0)
        text, finish, usage = out.choices[0].message.content, out.choices[0].finish_reason, out.usage
        assert out.choices[0].message.role == "assistant" and out.object == "chat.completion"
    assert text == _printed(ref, eos) and text.strip()
    assert "<|im_end|>" not in text
    assert finish == _finish(ref, eos, MAX)
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ref.prompt_ids), len(ref.token_ids))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_dgr_generate_prints_no_end_of_generation_marker(route, rc):
    """A chat-formatted prompt the model answers and ends with <|im_end|>: `dgr generate` prints the answer
    without the marker (as the gateway), and `--no-prefix-cache` prints the same."""
    prompt = "<|im_start|>user\nWhat is 2+2? Answer in one short sentence.<|im_end|>\n<|im_start|>assistant\n"
    ref = rc.run(prompt, max_new_tokens=48)
    eos = set(rc.hops[-1].eos_token_ids)
    assert ref.token_ids[-1] in eos and "<|im_end|>" in ref.text     # the route drew the marker
    outs = [subprocess.run([sys.executable, "-m", "dgr", "generate", "--route", route.route, "--max-tokens", "48",
                            *flags, prompt], capture_output=True, text=True, timeout=120) for flags in ((), ("--no-prefix-cache",))]
    assert all(o.returncode == 0 for o in outs), [o.stderr for o in outs]
    assert outs[0].stdout == outs[1].stdout == _printed(ref, eos) + "\n"
    assert "<|im_end|>" not in outs[0].stdout and outs[0].stdout.strip()


@pytest.mark.parametrize("stream", [False, True])
def test_completion_equals_dgr_generate(gw, route, rc, stream):
    ref = rc.run(PROMPT, max_new_tokens=MAX)
    cli = subprocess.run([sys.executable, "-m", "dgr", "generate", "--route", route.route, "--max-tokens", str(MAX),
                          PROMPT], capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    eos = set(rc.hops[-1].eos_token_ids)
    assert cli.stdout == _printed(ref, eos) + "\n"            # no end-of-generation marker, as the gateway
    c = gw.client()
    if stream:
        chunks = list(c.completions.create(model=gw.backend.info.name, prompt=PROMPT, max_tokens=MAX,
                                           temperature=0, stream=True))
        text = "".join(ch.choices[0].text for ch in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        out = c.completions.create(model=gw.backend.info.name, prompt=PROMPT, max_tokens=MAX, temperature=0)
        text, finish = out.choices[0].text, out.choices[0].finish_reason
        assert out.usage.prompt_tokens == len(ref.prompt_ids) and out.usage.completion_tokens == len(ref.token_ids)
    assert text == _printed(ref, eos)
    assert finish == _finish(ref, eos, MAX)


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_that_spans_tokens_is_never_printed(gw, rc, stream):
    ref = rc.run(PROMPT, max_new_tokens=MAX, stop_token_ids=[])
    pieces = [e.text for e in ref.events]
    # a stop string made of the end of one token and the start of the next, well inside the text
    k = next(i for i in range(3, len(pieces) - 1) if len(pieces[i].strip()) >= 2 and len(pieces[i + 1].strip()) >= 2)
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    full = "".join(pieces)
    want = full[:full.find(stop)]
    upto = next(j for j in range(len(pieces)) if stop in "".join(pieces[:j + 1]))   # the token completing it
    c = gw.client()
    kw = dict(model=gw.backend.info.name, prompt=PROMPT, max_tokens=MAX, temperature=0, stop=[stop, "\x00never"],
              extra_body={"ignore_eos": True})
    if stream:
        chunks = list(c.completions.create(stream=True, **kw))
        texts = [ch.choices[0].text for ch in chunks]
        assert not any(stop in t for t in texts)
        text, finish = "".join(texts), chunks[-1].choices[0].finish_reason
    else:
        out = c.completions.create(**kw)
        text, finish = out.choices[0].text, out.choices[0].finish_reason
        assert out.usage.completion_tokens == upto + 1              # it stopped at the token that completed it
    assert text == want and stop not in text
    assert finish == "stop"


def test_n_ctx_and_over_long_prompts_are_400(gw):
    c = gw.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=gw.backend.info.name, prompt="word " * 600, max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.status_code == 400
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=gw.backend.info.name, messages=MESSAGES, max_tokens=500)
    assert e.value.body["param"] == "max_tokens" and "512" in e.value.body["message"]


def test_a_disconnect_mid_stream_closes_the_session_on_every_stage(gw, route):
    c = gw.client()
    s = c.completions.create(model=gw.backend.info.name, prompt=PROMPT, max_tokens=400, temperature=0, stream=True,
                             extra_body={"ignore_eos": True})
    it = iter(s)
    for _ in range(3):
        next(it)
    assert open_sessions(route.addresses) == [1, 1, 1]
    s.close()                                                      # the client goes away mid-stream
    assert wait_no_sessions(route.addresses, 15) == [0, 0, 0]
    text = requests.get(gw.url + "/metrics").text
    assert metric(text, "dgr_gateway_open_streams") == 0 and metric(text, "dgr_gateway_active_generations") == 0


def test_metrics_move_after_a_request(gw):
    get = lambda: requests.get(gw.url + "/metrics")                # noqa: E731 (what curl does)
    r0 = get()
    assert r0.status_code == 200 and r0.headers["content-type"].startswith("text/plain")
    out = gw.client().completions.create(model=gw.backend.info.name, prompt=PROMPT, max_tokens=5, temperature=0)
    before, after = r0.text, get().text
    delta = lambda name, **kw: metric(after, name, **kw) - metric(before, name, **kw)   # noqa: E731
    assert delta("dgr_gateway_requests_total", endpoint="/v1/completions", status="200") == 1
    assert delta("dgr_gateway_generated_tokens_total") == out.usage.completion_tokens
    assert delta("dgr_gateway_prompt_tokens_total") == out.usage.prompt_tokens
    assert delta("dgr_gateway_time_to_first_token_seconds_count") == 1
    assert delta("dgr_gateway_token_latency_seconds_count") == out.usage.completion_tokens - 1
    assert delta("dgr_gateway_requests_total", endpoint="/metrics", status="200") == 1


def test_dgr_serve_process_with_a_model_name(route, rc):
    with serve_process(route.route, "--model-name", "smol") as (proc, url):
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in c.models.list().data] == ["smol"]
        out = c.chat.completions.create(model="smol", messages=MESSAGES, max_tokens=8, temperature=0)
        info_template = rc.hops[0].chat_template
        ref = rc.run(chat.render(info_template, MESSAGES), max_new_tokens=8)
        assert out.choices[0].message.content == _printed(ref, set(rc.hops[-1].eos_token_ids))
        with pytest.raises(openai.NotFoundError):
            c.chat.completions.create(model=rc.hops[0].identity.model + "-other", messages=MESSAGES)
        log = "".join(proc.output)
    assert "chat template from the GGUF's tokenizer.chat_template (stage 0)" in log, log
