"""Every ported architecture through real worker processes: a 3-stage bundle of its tiny model, one
dgr-worker process per stage, generates the whole model's greedy tokens and logits exactly."""

from __future__ import annotations

import numpy as np
import pytest

from dgr.toolchain.synth.generic import known_archs

pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.mark.parametrize("arch", known_archs())
def test_three_worker_processes_equal_the_whole_model(arch, engine_lib, tmp_path):
    from dgr.app.demo import whole_model_run
    from dgr.app.local import LocalRoute
    from dgr.runtime.engine import Engine
    from dgr.runtime.wire.client import RouteClient
    from dgr.toolchain.synth.generic import layer_kinds
    from dgr.toolchain.synth.parity import choose_ranges, model_layers, synth_model

    from support.engine import long_prompts, make_bundle

    layers = model_layers(arch)
    whole = synth_model(arch, tmp_path / f"{arch}.gguf", layers=layers)
    bundle = make_bundle(whole, choose_ranges(layer_kinds(arch, layers), 3), tmp_path)
    eng = Engine.open(whole, lib=engine_lib, n_threads=1)
    try:
        ids = long_prompts(eng.describe().n_vocab, lengths=(37,))[0]
        ref = whole_model_run(eng, ids, 6, chunk_tokens=16)  # prefill in the chunks the route uses
    finally:
        eng.close()
    args = [["--bundle", str(bundle.root), "--stage", str(i), "--threads", "1", "--n-ctx", "256"] for i in range(3)]
    with LocalRoute(args, env={"DGR_ENGINE_LIB": str(engine_lib)}, timeout=300) as r, \
            RouteClient(r.addresses, chunk_tokens=16) as c:
        gen = c.run(ids, max_new_tokens=6, logits="last", stop_token_ids=[])
    assert gen.token_ids == ref.token_ids
    assert all(np.array_equal(gen.logits[len(ids) - 1 + k], row) for k, row in enumerate(ref.logits))
