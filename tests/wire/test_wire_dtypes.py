"""Wire dtypes end to end: q8_0 is ggml's Q8_0 bit for bit, costs 34/128 of f32's bytes, is refused with
a clear error where a boundary's width does not fill its blocks, and carries real worker processes."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import numpy as np
import pytest

from dgr.core.contract import WIRE_DTYPES, StageContract
from dgr.core.errors import WireError
from dgr.runtime.wire import codec
from dgr.runtime.wire.gen import stage_pb2 as pb


def _ggml_q8_0(lib_path, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(blocks, dequantized) by ggml's own quantize_row_q8_0_ref / dequantize_row_q8_0 in the engine library."""
    lib = ctypes.CDLL(str(lib_path))
    for f in (lib.quantize_row_q8_0_ref, lib.dequantize_row_q8_0):
        f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None
    x = np.ascontiguousarray(x, np.float32).ravel()
    blocks = np.empty(x.size // 32 * 34, np.uint8)
    lib.quantize_row_q8_0_ref(x.ctypes.data, blocks.ctypes.data, x.size)
    y = np.empty(x.size, np.float32)
    lib.dequantize_row_q8_0(blocks.ctypes.data, y.ctypes.data, x.size)
    return blocks, y


@pytest.mark.engine
def test_q8_0_is_ggmls_block_bit_for_bit(engine_lib):
    rng = np.random.default_rng(5)
    x = np.concatenate([
        rng.standard_normal(32 * 50) * 10.0 ** rng.uniform(-6, 4, size=32 * 50),   # every scale
        np.zeros(32),                                                              # an all-zero block
        np.arange(-16, 16) + 0.5,                                                  # ties at every step
        rng.standard_normal(32) * 1e-40,                                           # subnormals
        np.full(32, 3.0e5),                                                        # large, f16 scale still finite
    ]).astype(np.float32)
    want_blocks, want = _ggml_q8_0(engine_lib, x)
    b = codec.encode(x.reshape(-1, 2, 32), pb.Q8_0)
    assert b.dtype == pb.Q8_0 and list(b.shape) == [x.size // 64, 2, 32]
    assert np.array_equal(np.frombuffer(b.data, np.uint8), want_blocks)
    got = codec.decode(pb.Boundary.FromString(b.SerializeToString()))
    assert got.shape == (x.size // 64, 2, 32) and got.dtype == np.float32
    assert np.array_equal(got.ravel(), want)


def test_q8_0_rounds_halves_away_from_zero_and_keeps_blocks_apart():
    x = np.zeros((1, 1, 64), np.float32)
    x[0, 0, :4] = [127.0, 2.5, -2.5, 0.49999997]       # scale 1: q = round(x)
    x[0, 0, 32:] = 1e-3                                 # its own block, its own scale
    y = codec.decode(codec.encode(x, pb.Q8_0))
    assert y[0, 0, :4].tolist() == [127.0, 3.0, -3.0, 0.0]
    assert np.allclose(y[0, 0, 32:], 1e-3, rtol=1e-3)


def test_q8_0_block_with_a_non_finite_value_comes_back_nan_and_spares_the_others():
    x = np.ones((2, 1, 32), np.float32)
    x[0, 0, 3] = np.inf
    y = codec.decode(codec.encode(x, pb.Q8_0))
    assert np.isnan(y[0]).all()
    assert np.array_equal(y[1], codec.decode(codec.encode(x[1:], pb.Q8_0))[0])
    assert np.allclose(y[1], 1.0, rtol=1e-3)


def test_q8_0_costs_34_of_128_bytes_of_f32():
    q8, f32 = WIRE_DTYPES["q8_0"], WIRE_DTYPES["f32"]
    for width in (64, 576, 4 * 4096):                   # tiny models, SmolLM2, V4's 4 streams
        assert q8.nbytes(width) / f32.nbytes(width) == 34 / 128 <= 0.27
    x = np.random.default_rng(0).standard_normal((3, 1, 576)).astype(np.float32)
    assert len(codec.encode(x, pb.Q8_0).data) == 3 * 612
    s = pb.BoundarySchema(n_streams=1, n_embd=576, dtype=pb.Q8_0)
    assert codec.seam_bytes_per_token(s) == 612
    assert codec.tokens_per_frame(1 << 20, 612) > codec.tokens_per_frame(1 << 20, 2304)


def test_a_width_that_is_not_whole_blocks_is_refused_where_the_dtype_is_chosen():
    with pytest.raises(ValueError, match=r"q8_0 packs 32 values per block.*48 values per token.*use f32, f16, bf16"):
        StageContract.plan(0, 2, 4, n_streams=1, n_embd=48, dtype="q8_0")
    c = StageContract.plan(0, 2, 4, n_streams=1, n_embd=48)
    with pytest.raises(WireError, match="--wire-dtype q8_0: .*not a multiple of 32"):
        c.with_dtype("q8_0")
    assert c.with_dtype("f16").dtype == "f16"
    assert StageContract.plan(0, 2, 4, n_streams=4, n_embd=8, dtype="q8_0").boundary_out.bytes_per_token == 34
    with pytest.raises(WireError, match="48 values per token: use f32, f16 or bf16"):
        codec.encode(np.zeros((2, 1, 48), np.float32), pb.Q8_0)
    with pytest.raises(ValueError, match="do not fill whole blocks"):
        codec.decode(pb.Boundary(dtype=pb.Q8_0, shape=[2, 1, 16], data=b"\0" * 34))
    with pytest.raises(ValueError, match="needs 68 bytes, got 67"):
        codec.decode(pb.Boundary(dtype=pb.Q8_0, shape=[2, 1, 32], data=b"\0" * 67))


def test_f32_stays_exact_and_f16_bf16_still_round_trip():
    x = np.random.default_rng(1).standard_normal((4, 1, 64)).astype(np.float32) * 50
    assert np.array_equal(codec.decode(codec.encode(x, pb.F32)), x)
    for code, rel in ((pb.F16, 2.0**-11), (pb.BF16, 2.0**-8)):
        y = codec.decode(codec.encode(x, code))
        assert np.all(np.abs(y - x) <= np.abs(x) * rel)


def test_a_fake_worker_route_runs_in_q8_0():
    """Three `dgr worker serve --fake-engine ... --wire-dtype q8_0` processes: the route advertises and
    carries q8_0 at both seams and generates."""
    from dgr.runtime.wire.client import RouteClient

    from support.route import fake_route

    with fake_route(spec="layers=6,embd=64,cuts=2:4,seed=8", extra=["--wire-dtype", "q8_0"]) as r, \
            RouteClient(r.addresses) as c:
        hops = c.describe()
        gen = c.run("Once upon a time", max_new_tokens=12, stop_token_ids=[])
    assert [h.schema_out.dtype for h in hops[:-1]] == [pb.Q8_0, pb.Q8_0]
    assert [h.seam_bytes_per_token for h in hops[:-1]] == [68, 68]
    assert len(gen.token_ids) == 12


def test_a_worker_asked_for_q8_0_on_a_width_it_cannot_block_says_so():
    p = subprocess.run([sys.executable, "-m", "dgr", "worker", "serve", "--listen", "127.0.0.1:0",
                        "--fake-engine", "layers=6,embd=16,cuts=2:4,seed=8", "--stage", "0",
                        "--wire-dtype", "q8_0"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert "--wire-dtype q8_0: wire dtype q8_0 packs 32 values per block" in p.stderr
    assert "16 values per token" in p.stderr and "use f32, f16, bf16" in p.stderr


@pytest.mark.engine
@pytest.mark.slow
def test_smollm2_through_worker_processes_in_q8_0_is_the_codecs_q8_0(engine_lib, smollm2_gguf):
    """SmolLM2 in 3 worker processes with --wire-dtype q8_0: 612 bytes per token at each seam (0.27 of
    f32's), and exactly the tokens and logits of the same split run in one process with every boundary
    through the codec's q8_0 (what docs/wire-dtypes.md measures), which are not f32's."""
    from dgr.app.demo import ensure_bundle
    from dgr.app.local import LocalRoute
    from dgr.runtime.wire.client import RouteClient
    from dgr.toolchain.parity import Schedule, ctx_for, open_stages, run_pipeline

    b = ensure_bundle(3, progress=False)[0]
    ranges = [(s.layer_begin, s.layer_end) for s in b.manifest.stages]
    args = [["--bundle", str(b.root), "--stage", str(i), "--threads", "1", "--n-ctx", "512",
             "--wire-dtype", "q8_0"] for i in range(3)]
    with LocalRoute(args, env={"DGR_ENGINE_LIB": str(engine_lib)}, timeout=300) as r, \
            RouteClient(r.addresses) as c:
        hops = c.describe()
        gen = c.run("The three primary colors are", max_new_tokens=24, logits="last", stop_token_ids=[])
    assert [h.seam_bytes_per_token for h in hops[:-1]] == [612, 612]
    assert [h.schema_out.dtype for h in hops[:-1]] == [pb.Q8_0, pb.Q8_0]

    q8 = lambda stage, session, x: codec.decode(codec.encode(x, pb.Q8_0))   # noqa: E731
    ids = gen.prompt_ids
    engines = open_stages([smollm2_gguf] * 3, ranges=ranges, n_ubatch=512, n_ctx=ctx_for([ids], 24),
                          max_sessions=1, lib=engine_lib, n_threads=1)
    try:
        sched = Schedule(prompts=[ids], steps=23)
        here, f32 = run_pipeline(engines, sched, boundary_transform=q8), run_pipeline(engines, sched)
    finally:
        for e in engines:
            e.close()
    assert gen.token_ids == here.generated[0]
    for k in range(1, 24):              # decode rows: position len(ids) - 1 + k
        assert np.array_equal(gen.logits[len(ids) - 1 + k], here.decode_logits[0][k - 1]), k
    assert not np.array_equal(here.decode_logits[0][0], f32.decode_logits[0][0])
