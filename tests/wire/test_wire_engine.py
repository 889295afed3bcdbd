"""The real engine behind real worker processes: SmolLM2 split 2, 3 and 4 ways equals the whole model."""

from __future__ import annotations

import numpy as np
import pytest

from dgr.app.local import LocalRoute
from dgr.runtime.wire.client import RouteClient
from dgr.runtime.wire.errors import StageError
from dgr.runtime.wire.stats import summarize

pytestmark = [pytest.mark.engine, pytest.mark.slow]

PROMPT = "The three primary colors are"
MAX_NEW = 16


@pytest.fixture(scope="module")
def whole(engine_lib, smollm2_gguf):
    """Greedy tokens and logits of the unsplit GGUF on the same engine (the independent baseline)."""
    from dgr.app.demo import whole_model_run
    from dgr.runtime.engine import Engine

    eng = Engine.open(smollm2_gguf, lib=engine_lib, n_threads=1)
    try:
        ids = eng.tokenize(PROMPT)
        yield ids, whole_model_run(eng, ids, MAX_NEW)
    finally:
        eng.close()


def _bundle(stages: int):
    from dgr.app.demo import ensure_bundle

    return ensure_bundle(stages, progress=False)[0]


def _route(engine_lib, stage_args):
    # one compute thread per worker: ggml's threads spin while waiting, and workers share the cores here
    return LocalRoute([[*a, "--threads", "1", "--n-ctx", "512"] for a in stage_args],
                      env={"DGR_ENGINE_LIB": str(engine_lib)}, timeout=300)


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_split_equals_whole_model_token_for_token_and_logits(stages, engine_lib, whole):
    ids, ref = whole
    b = _bundle(stages)
    with _route(engine_lib, [["--bundle", str(b.root), "--stage", str(i)] for i in range(stages)]) as r, \
            RouteClient(r.addresses) as c:
        gen = c.run(ids, max_new_tokens=MAX_NEW, logits="last", stop_token_ids=[])
        print(f"\n{stages} stages: {summarize(gen, stages)}; whole: prefill {ref.prefill_tokens_per_s:.1f} "
              f"tok/s, decode {ref.decode_tokens_per_s:.1f} tok/s")
    assert gen.token_ids == ref.token_ids
    rows = [gen.logits[len(ids) - 1 + k] for k in range(MAX_NEW)]
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(rows, ref.logits))
    assert all(np.array_equal(a, b) for a, b in zip(rows, ref.logits)), f"max |logit diff| {worst}"


def test_stages_of_different_bundles_are_refused_at_open(engine_lib):
    b3, b2 = _bundle(3), _bundle(2)
    # stage 0 of the 3-stage bundle hands over at layer 10; stage 1 of the 2-stage bundle starts at 15
    with _route(engine_lib, [["--bundle", str(b3.root), "--stage", "0"],
                             ["--bundle", str(b2.root), "--stage", "1"]]) as r, RouteClient(r.addresses) as c:
        with pytest.raises(StageError) as err:
            c.run("hi", max_new_tokens=2)
    msg = str(err.value)
    assert b3.id in msg and b2.id in msg and f"stage 1 ({r.addresses[1]})" in msg


def test_concurrent_sessions_share_batches_and_equal_sequential(engine_lib):
    from concurrent.futures import ThreadPoolExecutor

    b = _bundle(3)
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):", PROMPT]
    with _route(engine_lib, [["--bundle", str(b.root), "--stage", str(i)] for i in range(3)]) as r:
        def one(p):
            with RouteClient(r.addresses) as c:
                return c.run(p, max_new_tokens=12, stop_token_ids=[]).token_ids

        sequential = [one(p) for p in prompts]
        with ThreadPoolExecutor(len(prompts)) as pool:
            concurrent = list(pool.map(one, prompts))
    # Batched rows of different sessions are not bit-identical to unbatched ones in llama.cpp's kernels
    # (logits differ by up to ~1 here), so the contract under batching is the tokens.
    assert concurrent == sequential
    assert len({tuple(s) for s in sequential}) == len(prompts)


@pytest.mark.parametrize("arch", ["gemma3", "qwen3moe"])
def test_other_architectures_through_worker_processes(arch, engine_lib, tmp_path):
    """Tiny random-weight models (sliding-window attention; MoE) split 3 ways over the wire: exact."""
    from dgr.app.demo import whole_model_run
    from dgr.runtime.engine import Engine

    from support.engine import long_prompts, make_bundle, synth_model

    whole_path = synth_model(tmp_path, arch)
    bundle = make_bundle(whole_path, [(0, 2), (2, 3), (3, 6)], tmp_path)
    eng = Engine.open(whole_path, lib=engine_lib, n_threads=1)
    try:
        ids = long_prompts(eng.describe().n_vocab, lengths=(45,))[0]
        ref = whole_model_run(eng, ids, 8)
    finally:
        eng.close()
    with _route(engine_lib, [["--bundle", str(bundle.root), "--stage", str(i)] for i in range(3)]) as r, \
            RouteClient(r.addresses, chunk_tokens=16) as c:
        gen = c.run(ids, max_new_tokens=8, logits="last", stop_token_ids=[])
    assert gen.token_ids == ref.token_ids
    assert all(np.array_equal(gen.logits[len(ids) - 1 + k], row) for k, row in enumerate(ref.logits))


def test_long_prompt_under_a_small_message_limit_is_exact(engine_lib, smollm2_gguf):
    """A 300-token prompt through 3 workers with a 256 KiB message limit (about 110 tokens of boundary
    per frame): several chunks, no frame over the limit, and the tokens and logits of the whole model
    prefilled in the same chunks. (Under 200 KiB a logits row itself would not fit: refused at open.)"""
    from dgr.app.demo import long_prompt, whole_model_run
    from dgr.runtime.engine import Engine

    limit = 256 * 1024
    eng = Engine.open(smollm2_gguf, lib=engine_lib, n_threads=1)
    ids = long_prompt(eng.tokenize, 300)
    b = _bundle(3)
    args = [["--bundle", str(b.root), "--stage", str(i), "--max-message-bytes", str(limit)] for i in range(3)]
    try:
        with _route(engine_lib, args) as r, \
                RouteClient(r.addresses, max_message_bytes=limit, chunk_tokens=250) as c:
            gen = c.run(ids, max_new_tokens=4, logits="last", stop_token_ids=[])
            sent = [d.max_frame_bytes_sent for d in c.describe()]
        # the client lowered its chunks to what one frame of every seam holds; the baseline prefills alike
        assert 100 < gen.chunk_tokens < 250
        ref = whole_model_run(eng, ids, 4, chunk_tokens=gen.chunk_tokens)
    finally:
        eng.close()
    assert all(limit // 2 < s <= limit for s in sent[:2]), sent
    assert gen.token_ids == ref.token_ids
    assert all(np.array_equal(gen.logits[len(ids) - 1 + k], row) for k, row in enumerate(ref.logits))
