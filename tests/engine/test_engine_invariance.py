"""Batch invariance (CPU): a session's logits are bit-identical however its forwards are batched.

Not on which other sessions share its forwards (at other positions, prefilling or decoding), and not on
how its own tokens are cut: one prefill, chunks of any size, token by token (what a re-prefill after a
route change, a decode and a speculative verification step each are). Sharing and chunking are forced
here, forward by forward, through the engine itself: nothing depends on timing. The worker-level tests
(test_wire_engine.py, test_wire_recovery.py) force them through real workers.

Both invariant kernel sets are checked: "reference" (the default: ggml's reference kernels, every row alone) and
"invariant" (ggml's batch_invariant switch: flash attention's tiled kernel for every number of queries; repacked
Q4_K's gemm and Q6_K's tiled GEMM with one-row paths of their float order, vec_dot for the other types), at 1 and
2 compute threads. This machine's build is x86-64-v3 (AVX2 code paths, FMA, F16C; no AVX-512, no AMX).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from dgr.core.errors import EngineError
from dgr.runtime.engine import QUANT_FTYPES, Engine, quantize
from dgr.toolchain.synth.generic import known_archs, synth
from dgr.toolchain.synth.parity import NOT_BATCH_INVARIANT, synth_model as synth_parity_model

from support.engine import batching_differences, cut, logits_by_cuts

pytestmark = pytest.mark.engine

# every type llama.cpp's quantizer writes for a whole model (legacy, K-, I- and ternary quants, F16/BF16)
WEIGHT_TYPES = sorted(QUANT_FTYPES)


KERNEL_RUNS = [("reference", 1), ("reference", 2), ("invariant", 1), ("invariant", 2)]


@pytest.mark.parametrize("kernels,threads", KERNEL_RUNS)
def test_smollm2_logits_do_not_depend_on_batching(kernels, threads, smollm2_gguf, engine_lib):
    diffs = batching_differences(smollm2_gguf, engine_lib, kernels=kernels, n_threads=threads, n_vocab=49152)
    assert diffs == dict.fromkeys(diffs, 0.0), diffs


@pytest.fixture(scope="module")
def llama256(tmp_path_factory):
    # rows of 256: every K- and I-quant block fits, so the quantizer does not fall back to another type
    return synth("llama", 3, 256, 1, tmp_path_factory.mktemp("w") / "llama256.gguf")


def _matrix_types(path) -> set[str]:
    r = gguf.GGUFReader(path)
    return {t.tensor_type.name for t in r.tensors if len(t.shape) >= 2 and t.name.startswith("blk.")}


@pytest.fixture(scope="module")
def quantized(llama256, engine_lib, tmp_path_factory):
    """qtype -> llama256 quantized to it (made once per module)."""
    made = {}

    def get(qtype):
        if qtype not in made:
            model = quantize(llama256, tmp_path_factory.mktemp("q") / f"{qtype}.gguf", qtype, lib=engine_lib)
            assert _matrix_types(model) == {qtype}, f"the quantizer wrote {_matrix_types(model)} for {qtype}"
            made[qtype] = model
        return made[qtype]
    return get


@pytest.mark.parametrize("kernels,threads", KERNEL_RUNS)
@pytest.mark.parametrize("qtype", WEIGHT_TYPES)
def test_every_weight_type_is_batch_invariant(qtype, kernels, threads, quantized, engine_lib):
    diffs = batching_differences(quantized(qtype), engine_lib, kernels=kernels, n_threads=threads)
    assert diffs == dict.fromkeys(diffs, 0.0), f"{qtype} ({kernels}, {threads} threads): {diffs}"


@pytest.fixture(scope="module")
def wide_ffn(tmp_path_factory):
    # an FFN of 11008 (Llama-2-7B's): ffn_down's rows are 43 blocks of 256, past the one-row Q6_K kernel's groups of
    # 32 blocks and of 8 sums and into their tails, and the repacked Q4_K gemv's longest rows
    return synth("llama", 1, 256, 1, tmp_path_factory.mktemp("w") / "wide-ffn.gguf", n_ff=11008)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_rows_of_many_blocks_are_batch_invariant(qtype, threads, wide_ffn, engine_lib, tmp_path):
    model = quantize(wide_ffn, tmp_path / f"{qtype}.gguf", qtype, lib=engine_lib)
    diffs = batching_differences(model, engine_lib, kernels="invariant", n_threads=threads)
    assert diffs == dict.fromkeys(diffs, 0.0), f"{qtype} (invariant, {threads} threads): {diffs}"


@pytest.mark.parametrize("kernels", ["reference", "invariant"])
def test_long_prompts_over_several_attention_tiles_are_batch_invariant(kernels, quantized, engine_lib):
    """300 tokens: several 64-row query tiles and 64-cell KV tiles (the online softmax rescales across tiles, a
    last KV tile is partial, the cache's view grows past 256 cells while decoding token by token), cut several
    ways and beside another session, against the one-batch prefill."""
    rng = np.random.default_rng(3)
    a, b = (rng.integers(0, 200, size=n).tolist() for n in (300, 70))
    model = quantized("Q4_K")
    ref = logits_by_cuts(model, [(a, [len(a)])], engine_lib, kernels=kernels, n_ctx=512)[0]
    ways = {
        "chunks of 64, 1, 20": [(a, cut(len(a), [64, 1, 20]))],
        "chunks of 13": [(a, cut(len(a), [13]))],
        "token by token": [(a, [1] * len(a))],
        "beside a 70-token prefill": [(b, [len(b)]), (a, cut(len(a), [40, 7]))],
    }
    for name, sessions in ways.items():
        got = logits_by_cuts(model, sessions, engine_lib, kernels=kernels, n_ctx=512)
        mine = got[0] if sessions[0][0] is a else got[-1]
        assert float(np.abs(mine - ref).max()) == 0.0, f"{kernels}, {name}"


def test_the_invariant_kernels_run_the_tiled_attention(quantized, engine_lib):
    """The invariant kernels' flash attention is the tiled kernel (for every number of queries), not the reference
    one-query kernel: their logits differ on a model with attention, which shows which kernel ran."""
    tokens = np.random.default_rng(2).integers(0, 200, size=24).tolist()
    inv, ref = (logits_by_cuts(quantized("Q4_K"), [(tokens, [len(tokens)])], engine_lib, kernels=k)[0]
                for k in ("invariant", "reference"))
    assert np.abs(inv - ref).max() > 0, "the invariant kernels computed exactly what the reference ones do"


def test_the_invariant_kernels_compute_what_the_reference_ones_do_to_rounding(smollm2_gguf, engine_lib):
    """Invariance alone would pass a fast path that is wrong the same way for every batching (V rows read from the
    wrong cells, a tile's tail dropped): over a 150-token prompt (tiles of 64 cells and a partial last one) the
XX
    wherever the reference's top token clearly leads. The two differ only in how they round (attention's Q is F16 in
    the one-query kernel, F32 here); on random tokens many positions are near ties, which rounding may flip."""
    tokens = np.random.default_rng(3).integers(0, 5000, size=150).tolist()
    inv, ref = (logits_by_cuts(smollm2_gguf, [(tokens, [len(tokens)])], engine_lib, kernels=k, n_ctx=512)[0]
                for k in ("invariant", "reference"))
    scale = float(np.abs(ref).max())
    assert float(np.abs(inv - ref).max()) < 0.1 * scale
    assert float(np.mean(np.abs(inv - ref))) < 0.01 * scale
    top2 = np.sort(ref, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1.0
    assert clear.sum() >= 10
    assert np.array_equal(inv.argmax(-1)[clear], ref.argmax(-1)[clear])


@pytest.mark.parametrize("kernels", ["reference", "invariant"])
def test_threads_and_their_polling_change_no_bit(kernels, quantized, engine_lib):
    """Threads split rows and columns only, in one pool kept for the engine's life: 1 thread, 2 sleeping between
    graphs (poll 0) and 2 spinning (poll 50, llama.cpp's default) give the same bits, prefill and decode."""
    tokens = np.random.default_rng(4).integers(0, 200, size=40).tolist()
    cuts = [32] + [1] * 8
    runs = [logits_by_cuts(quantized("Q4_K"), [(tokens, cuts)], engine_lib, kernels=kernels, n_threads=t, poll=p)[0]
            for t, p in ((1, 0), (2, 0), (2, 50))]
    for got in runs[1:]:
        assert np.array_equal(got.view(np.uint32), runs[0].view(np.uint32))


def test_a_polling_level_outside_0_to_100_is_refused(quantized, engine_lib):
    with pytest.raises(EngineError, match=r"poll = 101: the threads' polling level must be 0-100"):
        Engine.open(quantized("Q4_K"), n_threads=2, poll=101, lib=engine_lib)


FALLBACK = "(the reference kernel: no invariant fast path)"


def _kernel_pairs(text: str) -> set[tuple[str, str]]:
    """"Q4_1, Q8_0: kernel; Q4_K: kernel" -> {(type, kernel)}"""
    out = set()
    for part in text.split("; "):
        types, kernel = part.split(": ", 1)
        out |= {(t, kernel) for t in types.split(", ")}
    return out


def _expected_kernel(t, tied: bool) -> str:
    """What patches 0027-0031 give a matrix on this x86-64-v3 build: Q4_K with rows in eights repacked (not the
    token embedding, which llama.cpp keeps in plain memory for its lookups), Q6_K the tiled GEMM, the rest vec_dot."""
    q = t.tensor_type.name
    if q == "Q4_K" and t.shape[1] % 8 == 0 and t.name != "token_embd.weight":
        return "repacked gemm, gemv in its float order"
    if q == "Q6_K":
        return "tiled GEMM from 8 rows, its float order below"
    if q in ("Q4_K", "Q6_K"):
        return "vec_dot, 4 columns at once " + FALLBACK
    return "vec_dot, each row alone " + FALLBACK


@pytest.mark.parametrize("qtype", ["Q4_K", "Q4_1", "Q8_0"])
def test_describe_names_the_kernel_of_every_weight_type_and_the_fallbacks(qtype, quantized, engine_lib):
    """Under the invariant kernels Describe says which weight types run a fast kernel (repacked Q4_K, Q6_K's tiled
    GEMM) and which fall back to the reference vec_dot, for every matrix of the model."""
    model = quantized(qtype)
    r = gguf.GGUFReader(model)
    tied = "output.weight" not in {t.name for t in r.tensors}
    # the matrices the stage multiplies: the token embedding only where it is also the output (tied)
    want = {(t.tensor_type.name, _expected_kernel(t, tied)) for t in r.tensors
            if len(t.shape) >= 2 and "norm" not in t.name and (t.name != "token_embd.weight" or tied)}
    with Engine.open(model, kernels="invariant", lib=engine_lib) as e:
        said = e.describe().matmul_kernels
        if e.numerics.split()[0] != "cpu/x86-64-v3":  # another ISA has other kernels (AVX-512 VNNI: Q6_K's vec_dot)
            pytest.skip(f"the expected kernels are the x86-64-v3 build's; this library is {e.numerics.split()[0]}")
    assert _kernel_pairs(said) == want, said
    for kernels, says in (("reference", "every matrix: vec_dot, each row alone (the reference kernels)"),
                          ("fast", "llama.cpp's own choice by the number of rows (not batch invariant)")):
        with Engine.open(model, kernels=kernels, lib=engine_lib) as e:
            assert e.describe().matmul_kernels == says


def test_the_check_sees_what_llama_cpps_fast_kernels_change(llama256, engine_lib, tmp_path):
    """The negative control: with llama.cpp's shape-dependent CPU kernels (the tiled K-quant GEMM from
    8 rows on) the same comparisons differ, so the checks above can fail."""
    model = quantize(llama256, tmp_path / "q4k.gguf", "Q4_K", lib=engine_lib)
    diffs = batching_differences(model, engine_lib, kernels="fast")
    assert diffs["token by token"] > 0 and diffs["chunks of 7"] > 0, diffs


# Their graphs cannot take one KV stream per session at the pin (llama.cpp aborts building them), so
# they keep one shared stream and are not batch invariant: Describe says so (docs/families.md).
NOT_INVARIANT = set(NOT_BATCH_INVARIANT)


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["reference", "invariant"])
@pytest.mark.parametrize("arch", known_archs())
def test_every_family_is_batch_invariant_or_says_it_is_not(arch, kernels, engine_lib, tmp_path):
    model = synth_parity_model(arch, tmp_path / f"{arch}.gguf")
    with Engine.open(model, n_ctx=64, max_sessions=2, kernels=kernels, lib=engine_lib) as e:
        assert e.describe().batch_invariant == (arch not in NOT_INVARIANT)
    if arch in NOT_INVARIANT:
        return
    diffs = batching_differences(model, engine_lib, kernels=kernels)
    assert diffs == dict.fromkeys(diffs, 0.0), f"{arch} ({kernels}): {diffs}"
