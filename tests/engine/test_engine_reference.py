"""The patch stack changes nothing for a whole model: the patched library computes every logit
byte-identically to the same engine built over the UNPATCHED pinned llama.cpp (built once, cached
in the workspace as build/cpu-pristine). Both run llama.cpp's own fast CPU kernels here: the one
patch that changes arithmetic on purpose (0024, the reference kernels of batch invariance) is switched
off by `fast_kernels`, and an unpatched engine has no such switch."""

from __future__ import annotations

import numpy as np
import pytest

from dgr.core.errors import EngineError
from dgr.runtime.engine import Engine
from dgr.toolchain.parity import Schedule, open_stages, run_pipeline
from dgr.toolchain.synth.generic import known_archs
from dgr.toolchain.synth.parity import synth_model as synth_parity_model

from support.engine import long_prompts, synth_model

pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.fixture(scope="session")
def pristine_lib():
    from dgr.toolchain.enginebuild import ensure_engine

    return ensure_engine("cpu", pristine=True, defines={"DGR_WITH_HOOKS": "OFF"})


def _run(path, lib, sched):
    n_ctx = max(len(p) for p in sched.prompts) + sched.steps + 8
    [e] = open_stages([path], n_ubatch=sched.n_ubatch, n_ctx=n_ctx, max_sessions=len(sched.prompts), lib=lib,
                      fast_kernels=True)
    try:
        return run_pipeline([e], sched)
    finally:
        e.close()


@pytest.mark.parametrize("arch", known_archs())
def test_patched_whole_model_is_byte_identical_to_unpatched(arch, engine_lib, pristine_lib, tmp_path):
    """Every ported architecture (`dgr synth --list`): the patch stack is the identity on a whole model."""
    if arch == "deepseek4":
        from dgr.toolchain.synth.deepseek4 import synth_deepseek4

        model = synth_deepseek4(tmp_path / "v4.gguf", layers=4)
        sched = Schedule(prompts=long_prompts(256, lengths=(150, 133)), steps=3, n_ubatch=64)
    else:
        model = synth_parity_model(arch, tmp_path / f"{arch}.gguf")
        sched = Schedule(prompts=long_prompts(256), steps=4, n_ubatch=16)
    a, b = _run(model, engine_lib, sched), _run(model, pristine_lib, sched)
    for k in range(len(sched.prompts)):
        assert a.prefill_logits[k].tobytes() == b.prefill_logits[k].tobytes()
        assert a.decode_logits[k].tobytes() == b.decode_logits[k].tobytes()
    assert a.generated == b.generated


def test_smollm2_patched_is_byte_identical_to_unpatched(smollm2_gguf, engine_lib, pristine_lib):
    with Engine.open(smollm2_gguf, n_ctx=64, max_sessions=1, lib=engine_lib) as e:
        ids = e.tokenize("The capital of France is")
    sched = Schedule(prompts=[ids], steps=6, n_ubatch=512)
    a, b = _run(smollm2_gguf, engine_lib, sched), _run(smollm2_gguf, pristine_lib, sched)
    assert np.array_equal(a.prefill_logits[0].view(np.uint32), b.prefill_logits[0].view(np.uint32))
    assert np.array_equal(a.decode_logits[0].view(np.uint32), b.decode_logits[0].view(np.uint32))


def test_unpatched_engine_refuses_a_range(pristine_lib, tmp_path):
    model = synth_model(tmp_path, "llama")
    with pytest.raises(EngineError, match="without the dgr hooks"):
        Engine.open(model, layer_range=(0, 2), lib=pristine_lib)
