"""End of generation as llama.cpp sees it: `dgr_vocab_read` / `Engine.vocab()` give bos, eos, eot and every
id `llama_vocab_is_eog` marks; a worker advertises all of them (Describe's eos_token_ids, the eos first),
and a route and its gateway stop at any of them with finish_reason "stop".

The model: a tiny synthetic llama whose tokenizer.ggml.eot_token_id is set to the very token it generates
first (greedily) for a chat prompt, a token that is neither its eos nor one of the texts llama.cpp knows
as an end of turn. A worker that advertised the eos alone would chat on past it."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import pytest

from dgr.app.gateway import chat
from dgr.app.local import LocalRoute
from dgr.core.errors import EngineError
from dgr.runtime import engine as engine_mod
from dgr.runtime.engine import Engine, read_vocab
from dgr.runtime.engine_api import Step
from dgr.runtime.wire.client import RouteClient

from support.engine import make_bundle, synth_model
from support.gateway import gateway
from support.paths import REPO

pytestmark = pytest.mark.engine

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MAX = 40


def _with_kvs(src: Path, dst: Path, **kvs) -> Path:
    """A copy of the GGUF `src` with the keys `kvs` (int: uint32, str: string) set or replaced."""
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), str(r.fields["general.architecture"].contents()))
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in kvs:
            continue
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, f.contents(), f.types[0], sub_type=f.types[-1])
        else:
            w.add_key_value(name, f.contents(), f.types[0])
    for key, val in kvs.items():
        w.add_key_value(key, val, gguf.GGUFValueType.STRING if isinstance(val, str) else gguf.GGUFValueType.UINT32)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=tuple(int(x) for x in reversed(t.shape.tolist())),
                     raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _first_greedy_token(path: Path, prompt: str, lib) -> int:
    with Engine.open(path, n_ctx=256, max_sessions=1, lib=lib) as e:
        ids = e.tokenize(prompt, add_special=True)
        e.open_session("s", 0)
        [r] = e.forward([Step("s", 0, np.arange(len(ids), dtype=np.int32), token_ids=np.asarray(ids, np.int32))])
        return int(r.next_token)


@pytest.fixture(scope="module")
def eot_model(tmp_path_factory, engine_lib):
    """(the model, the chat messages, the end-of-turn token it generates first for them, its eos)."""
    d = tmp_path_factory.mktemp("eog")
    whole = synth_model(d, "llama", layers=4, embd=64)
    plain = read_vocab(whole, lib=engine_lib)
    for content in ("hello", "What is the capital of France?", "tell me a story", "2 + 2 = ?", "why"):
        messages = [{"role": "user", "content": content}]
        first = _first_greedy_token(whole, chat.render(TEMPLATE, messages), engine_lib)
        if first not in plain.eog:
            break
    else:
        pytest.fail(f"every prompt's first greedy token is an end-of-generation token of {whole}")
    model = _with_kvs(whole, d / "eot.gguf", **{gguf.Keys.Tokenizer.EOT_ID: first,
                                                gguf.Keys.Tokenizer.CHAT_TEMPLATE: TEMPLATE})
    return model, messages, first, plain.eos


def test_the_vocabulary_says_every_end_of_generation_id(eot_model, engine_lib, tmp_path):
    model, _, eot, eos = eot_model
    v = read_vocab(model, lib=engine_lib)
    assert (v.eot, v.eos) == (eot, eos) and eot != eos
    assert eot in v.eog and eos in v.eog and list(v.eog) == sorted(set(v.eog))
    assert v.stop_ids[0] == eos and set(v.stop_ids) == set(v.eog)
    with Engine.open(model, n_ctx=64, max_sessions=1, lib=engine_lib) as e:
        assert e.vocab() == v
    # every stage file keeps the tokenizer, and with it the same ids
    bundle = make_bundle(model, [(0, 2), (2, 4)], tmp_path / "b")
    assert [read_vocab(p, lib=engine_lib) for p in bundle.stage_paths] == [v, v]
    # the known end-of-turn texts count too (the synthetic vocabulary has <|im_end|>), as in llama-server
    toks = gguf.GGUFReader(str(model)).fields[gguf.Keys.Tokenizer.LIST].contents()
    assert toks.index("<|im_end|>") in v.eog


def test_smollm2_stops_at_its_end_of_text_as_well_as_its_eos(smollm2_gguf, engine_lib):
    v = read_vocab(smollm2_gguf, lib=engine_lib)
    assert (v.bos, v.eos) == (1, 2)                      # <|im_start|>, <|im_end|>
    assert {0, 2} <= set(v.eog) and v.stop_ids[0] == 2   # <|endoftext|> ends a generation as well


def test_read_vocab_of_a_file_that_is_not_a_model_says_which(engine_lib, tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(EngineError, match=re.escape(str(bad))):
        read_vocab(bad, lib=engine_lib)
    with pytest.raises(EngineError, match="no such file"):
        read_vocab(tmp_path / "absent.gguf", lib=engine_lib)


def test_the_c_abi_version_is_one_number(engine_lib):
    header = (REPO / "worker/engine/dgr_engine.h").read_text()
    [v] = re.findall(r"#define DGR_ABI_VERSION (\d+)", header)
    from dgr.runtime.engine_abi import ABI_VERSION

    assert int(v) == ABI_VERSION == engine_mod.load_library(engine_lib).dgr_abi_version()


def test_a_route_and_its_gateway_stop_at_the_end_of_turn(eot_model, engine_lib, tmp_path):
    model, messages, eot, eos = eot_model
    bundle = make_bundle(model, [(0, 2), (2, 4)], tmp_path / "b")
    stages = [["--bundle", str(bundle.root), "--stage", str(i), "--threads", "1", "--n-ctx", "256"] for i in range(2)]
    with LocalRoute(stages, env={"DGR_ENGINE_LIB": str(engine_lib)}, timeout=300) as route:
        with RouteClient(route.addresses) as rc:
            stops = list(rc.hops[-1].eos_token_ids)
            assert stops[0] == eos and eot in stops           # Describe: every end-of-generation id, eos first
            gen = rc.run(chat.render(TEMPLATE, messages), max_new_tokens=MAX)
            assert gen.token_ids == [eot]                     # `dgr generate` stops there too
        with gateway(route.route) as g:
            info = g.backend.info
            assert "GGUF" in info.chat_template_source and info.chat_template == TEMPLATE
            c = g.client()
            out = c.chat.completions.create(model=info.name, messages=messages, max_tokens=MAX, temperature=0)
            assert out.choices[0].finish_reason == "stop"
            assert out.usage.completion_tokens == 1 and out.choices[0].message.content == ""
            chunks = list(c.chat.completions.create(model=info.name, messages=messages, max_tokens=MAX,
                                                    temperature=0, stream=True))
            assert [ch.choices[0].finish_reason for ch in chunks if ch.choices[0].finish_reason] == ["stop"]
            assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ""
            # the same token with the stops ignored: the route really generated it, and goes on past it
            out = c.chat.completions.create(model=info.name, messages=messages, max_tokens=MAX, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == MAX
