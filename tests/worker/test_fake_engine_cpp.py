"""The fake engine as a C++ library behind the real engine's C ABI (worker/fake; issue 21): through
dgr.runtime.engine's ctypes in this process (dgr.testing.fake_engine.FakeEngine) and inside real dgr-worker
processes (`dgr-worker --fake-engine SPEC --stage N`).

In process: split == whole bit for bit, batching and chunking change no bit, a truncate is bit for bit the
cache of the shorter history, and every refusal is typed (cache miss, schema, sideband, context, sessions,
recurrent). Across processes: a route of dgr-workers generates the tokens and logits of the in-process
whole model (greedy, and sampled with the library's own sampler, dgr_sample), and a dgr-worker's Describe is
what the fake stage and the flags say. The library's ggml wire-dtype converters are the real engine
library's bit for bit, so a route of dgr-workers on a lossy wire dtype generates what the in-process stages
do with the seams converted by numpy (dgr.runtime.wire.codec).
"""

from __future__ import annotations

import ctypes as C
import json
import os
import platform
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from dgr.core.errors import CacheMiss, EngineError, SchemaMismatch
from dgr.runtime.engine_api import Step
from dgr.runtime.wire import codec
from dgr.runtime.wire.client import RouteClient
from dgr.runtime.wire.gen import stage_pb2 as pb
from dgr.testing import fake_engine
from dgr.testing.fake_engine import EOS, FakeEngine, FakeModel

from support.engine import b3, fake_split
from support.worker import Proc

SPEC = "layers=7,embd=8,streams=2,cuts=2:5,hash_layers=3,seed=3"
TEXT = "a fake model, now in C++"


def _prefill(e: FakeEngine, sid: str, ids: list[int], chunks: list[tuple[int, int]], want: str = "all"):
    rows = []
    for lo, hi in chunks:
        r = e.forward([Step(sid, 1, np.arange(lo, hi), np.array(ids[lo:hi]), want_logits=want)])[0]
        rows.append(r.logits)
    return np.concatenate(rows)


@pytest.mark.parametrize("spec", [SPEC, "layers=5,embd=16,cuts=1:2:4,seed=9", "layers=3,embd=4,cuts=,seed=2"])
def test_stages_compose_to_the_whole_model_bit_for_bit(spec):
    model = FakeModel.from_spec(spec)
    whole = FakeEngine(model)
    ids = whole.tokenize(TEXT)
    whole.open_session("s", 1)
    ref = _prefill(whole, "s", ids, [(0, len(ids))])
    assert ref.shape == (len(ids), model.vocab) and ref.dtype == np.float32 and np.isfinite(ref).all()
    for chunks in ([(0, len(ids))], [(0, 1), (1, 7), (7, len(ids))], [(i, i + 1) for i in range(len(ids))]):
        assert np.array_equal(fake_split(model, ids, chunks), ref)


def test_batching_and_chunking_change_no_bit():
    model = FakeModel.from_spec(SPEC)
    e = FakeEngine(model)
    a, b = e.tokenize("first session"), e.tokenize("second one, longer")
    e.open_session("a", 1)
    e.open_session("b", 1)
    alone_a = _prefill(e, "a", a, [(0, len(a))])
    alone_b = _prefill(e, "b", b, [(0, len(b))])
    e.open_session("a2", 1)
    e.open_session("b2", 1)
    # both sessions in one forward, cut differently
    r1 = e.forward([Step("a2", 1, np.arange(0, 5), np.array(a[:5]), want_logits="all"),
                    Step("b2", 1, np.arange(0, 2), np.array(b[:2]), want_logits="all")])
    r2 = e.forward([Step("b2", 1, np.arange(2, len(b)), np.array(b[2:]), want_logits="all"),
                    Step("a2", 1, np.arange(5, len(a)), np.array(a[5:]), want_logits="all")])
    assert np.array_equal(np.concatenate([r1[0].logits, r2[1].logits]), alone_a)
    assert np.array_equal(np.concatenate([r1[1].logits, r2[0].logits]), alone_b)
    # want_logits last and none: the same rows, the same greedy token
    e.open_session("c", 1)
    r = e.forward([Step("c", 1, np.arange(len(a)), np.array(a), want_logits="last")])[0]
    assert np.array_equal(r.logits[0], alone_a[-1]) and r.next_token == int(np.argmax(alone_a[-1]))
    e.open_session("d", 1)
    r = e.forward([Step("d", 1, np.arange(len(a)), np.array(a), want_logits="none")])[0]
    assert r.logits.shape == (0, model.vocab) and r.next_token == int(np.argmax(alone_a[-1]))


def test_outputs_depend_on_history_and_seed():
    model = FakeModel.from_spec(SPEC)
    e = FakeEngine(model)
    e.open_session("a", 1)
    e.open_session("b", 1)
    ra = e.forward([Step("a", 1, np.arange(2), np.array([5, 9]), want_logits="all")])[0]
    rb = e.forward([Step("b", 1, np.arange(2), np.array([6, 9]), want_logits="all")])[0]
    assert not np.array_equal(ra.logits[1], rb.logits[1])
    other = FakeEngine(SPEC.replace("seed=3", "seed=4"))
    other.open_session("a", 1)
    ro = other.forward([Step("a", 1, np.arange(2), np.array([5, 9]), want_logits="all")])[0]
    assert not np.array_equal(ra.logits, ro.logits)
    again = FakeEngine(model)
    again.open_session("a", 1)
    assert np.array_equal(again.forward([Step("a", 1, np.arange(2), np.array([5, 9]), want_logits="all")])[0].logits,
                          ra.logits)


def test_truncate_is_the_cache_of_the_shorter_history_bit_for_bit():
    model = FakeModel.from_spec(SPEC)
    ids = FakeEngine(model).tokenize(TEXT)
    for stage in (None, 1, 2):
        e = FakeEngine(model, stage)
        info = e.describe()
        assert info.can_truncate
        e.open_session("s", 1)
        e.open_session("t", 1)
        b = None
        if not info.is_first:
            b = np.random.default_rng(1).standard_normal((len(ids), model.streams, model.embd)).astype(np.float32)

        def step(sid, lo, hi):
            return Step(sid, 1, np.arange(lo, hi), np.array(ids[lo:hi]), boundary=None if b is None else b[lo:hi],
                        want_logits="all")

        e.forward([step("s", 0, len(ids))])
        e.truncate("s", 1, 6)
        assert e.n_cached("s", 1) == 6
        e.forward([step("t", 0, 6)])
        got, want = e.forward([step("s", 6, 10)])[0], e.forward([step("t", 6, 10)])[0]
        for x, y in ((got.logits, want.logits), (got.boundary, want.boundary)):
            assert (x is None and y is None) or np.array_equal(x, y)
        with pytest.raises(EngineError, match="cannot keep 11"):
            e.truncate("s", 1, 11)


def test_refusals_are_typed_and_change_nothing():
    model = FakeModel.from_spec(SPEC)
    s1 = FakeEngine(model, 1)
    info = s1.describe()
    assert info.needs_token_ids and not info.is_first and not info.is_last
    assert info.contract.token_ids_out is False and FakeEngine(model, 0).describe().contract.token_ids_out
    s1.open_session("s", 1)
    b = np.zeros((2, 2, 8), np.float32)
    with pytest.raises(CacheMiss) as miss:
        s1.forward([Step("s", 1, np.arange(3, 5), np.array([1, 2]), boundary=b)])
    assert (miss.value.held, miss.value.expected) == (0, 3)
    with pytest.raises(SchemaMismatch, match="token ids"):
        s1.forward([Step("s", 1, np.arange(2), None, boundary=b)])
    with pytest.raises(SchemaMismatch, match=r"\[2, 2, 8\]"):
        s1.forward([Step("s", 1, np.arange(2), np.array([1, 2]), boundary=np.zeros((2, 1, 8), np.float32))])
    with pytest.raises(EngineError, match="no open session"):
        s1.forward([Step("t", 1, np.arange(2), np.array([1, 2]), boundary=b)])
    with pytest.raises(EngineError, match="contiguous"):
        s1.forward([Step("s", 1, np.array([0, 2]), np.array([1, 2]), boundary=b)])
    with pytest.raises(EngineError, match="out of range"):
        s1.forward([Step("s", 1, np.arange(2), np.array([1, model.vocab]), boundary=b)])
    with pytest.raises(EngineError, match="at most one step per session"):
        s1.forward([Step("s", 1, np.arange(2), np.array([1, 2]), boundary=b)] * 2)
    # all or nothing: a good step beside a bad one does not run
    s1.open_session("u", 1)
    with pytest.raises(CacheMiss):
        s1.forward([Step("u", 1, np.arange(2), np.array([1, 2]), boundary=b),
                    Step("s", 1, np.arange(1, 3), np.array([1, 2]), boundary=b)])
    assert s1.n_cached("s", 1) == 0 and s1.n_cached("u", 1) == 0
    with pytest.raises(EngineError, match="already open"):
        s1.open_session("s", 1)


def test_context_sessions_and_recurrent_limits():
    e = FakeEngine("layers=2,embd=4,cuts=,ctx=5,sessions=2,recurrent=1")
    info = e.describe()
    assert (info.n_ctx, info.max_sessions, info.can_truncate) == (5, 2, False)
    e.open_session("a", 1)
    e.open_session("b", 1)
    with pytest.raises(EngineError, match="all 2 sessions are in use"):
        e.open_session("c", 1)
    e.close_session("b", 1)
    e.open_session("c", 1)
    with pytest.raises(EngineError, match="position 5 is beyond the context of 5"):
        e.forward([Step("a", 1, np.arange(6), np.arange(3, 9), want_logits="last")])
    e.forward([Step("a", 1, np.arange(4), np.arange(3, 7), want_logits="last")])
    with pytest.raises(EngineError, match="recurrent"):
        e.truncate("a", 1, 2)
    e.truncate("a", 1, 4)                     # keeping everything is no rollback
    assert e.n_cached("a", 1) == 4


def test_vocabulary_and_memory():
    e = FakeEngine(SPEC)
    assert e.tokenize("hé") == [1, 3 + 104, 3 + 0xC3, 3 + 0xA9]
    assert e.tokenize("x", add_special=False) == [3 + 120]
    assert e.detokenize([1, 3 + 104, 3 + 0xC3, 3 + 0xA9, 2, 0]) == "hé"
    v = e.vocab()
    assert (v.bos, v.eos, v.eot, v.eog, v.stop_ids) == (1, EOS, None, (EOS,), (EOS,)) and e.eos_token_ids() == [EOS]
    m = e.memory()
    assert m.weights_bytes > 0 and m.kv_bytes == 0 and m.layers_with_state == tuple(range(7))
    e.open_session("s", 1)
    e.forward([Step("s", 1, np.arange(3), np.array([3, 4, 5]), want_logits="none")])
    assert e.memory().kv_bytes > 0 and e.sessions == {("s", 1)}
    e.close()
    assert e.closed and not e.sessions
    with pytest.raises(EngineError, match="closed"):
        e.forward([Step("s", 1, np.arange(1), np.array([3]))])


def test_the_library_writes_the_python_canonical_spec():
    lib = C.CDLL(str(fake_engine.library_path()))
    lib.dgr_fake_spec.argtypes = [C.c_char_p, C.c_char_p, C.c_int32, C.POINTER(C.c_int32)]
    lib.dgr_fake_spec.restype = C.c_int32
    lib.dgr_last_error.restype = C.c_char_p
    for spec in (SPEC, "", "layers=9,cuts=3,recurrent=1", " seed=7 , ctx=64,cuts=1:2:3,, sessions=3"):
        buf, n = C.create_string_buffer(512), C.c_int32()
        size = lib.dgr_fake_spec(spec.encode(), buf, 512, C.byref(n))
        m = FakeModel.from_spec(spec)
        assert buf.value.decode() == m.to_spec() and size == len(m.to_spec()) and n.value == len(m.ranges)
    for bad, why in (("layers=4,colour=blue", "bad item 'colour=blue'"), ("layers=4,cuts=4", "cuts=(4,)"),
                     ("vocab=100", "vocab=100 must be at least 259"), ("stage=1", "bad item 'stage=1'"),
                     ("layers=x", "'x' is not an integer")):
        assert lib.dgr_fake_spec(bad.encode(), None, 0, None) == -1
        assert why in lib.dgr_last_error().decode()
    with pytest.raises(EngineError, match="there is no stage 3"):
        FakeEngine(SPEC, 3)
    m = FakeModel.from_spec(SPEC)                    # the spec's round trip, its cuts and its seed in the bundle id
    assert FakeModel.from_spec(m.to_spec()) == m and m.ranges == [(0, 2), (2, 5), (5, 7)]
    assert FakeModel.from_spec(SPEC.replace("seed=3", "seed=4")).bundle_id != m.bundle_id


def test_every_build_of_the_library_gives_the_same_bits(monkeypatch):
    """The library found (beside the engine: CMake's -O3, or Bazel's) and the one built on demand (-O2)."""
    from dgr.core.paths import REPO_ROOT

    if not all((REPO_ROOT / s).is_file() for s in fake_engine.sources(REPO_ROOT)):
        pytest.skip("the fake engine's sources are not in this tree (an installed dgr)")
    rows = []
    for lib in {fake_engine.library_path(), fake_engine.build_library()}:
        monkeypatch.setenv(fake_engine.LIB_ENV, str(lib))
        e = FakeEngine(SPEC)
        ids = e.tokenize(TEXT)
        e.open_session("s", 1)
        rows.append(_prefill(e, "s", ids, [(0, len(ids))]))
    assert all(np.array_equal(r, rows[0]) for r in rows)


# --- dgr-worker processes


@pytest.fixture(scope="module")
def fake_lib() -> str:
    """The one fake library of this module: the in-process engines and every worker process load it."""
    path = str(fake_engine.library_path())
    old = os.environ.get(fake_engine.LIB_ENV)
    os.environ[fake_engine.LIB_ENV] = path
    yield path
    if old is None:
        os.environ.pop(fake_engine.LIB_ENV, None)
    else:
        os.environ[fake_engine.LIB_ENV] = old


def cpp_fake(worker_bin, spec: str, stage: int, *extra: str) -> Proc:
    return Proc([str(worker_bin), "--fake-engine", spec, "--stage", str(stage), "--listen", "127.0.0.1:0", *extra])


@pytest.fixture(scope="module")
def cpp_route(worker_bin, fake_lib):
    procs = []
    try:
        for i in range(len(FakeModel.from_spec(SPEC).ranges)):
            procs.append(cpp_fake(worker_bin, SPEC, i))
        yield [p.address for p in procs]
    finally:
        for p in procs:
            print(p.stop()[-2000:])


def _whole_model(ids: list[int], n: int, spec: str = SPEC) -> tuple[list[int], np.ndarray]:
    e = FakeEngine(spec)
    e.open_session("ref", 1)
    r = e.forward([Step("ref", 1, np.arange(len(ids)), np.array(ids), want_logits="all")])[0]
    rows, out, pos = [r.logits], [], len(ids)
    while True:
        out.append(r.next_token)
        if len(out) == n:
            return out, np.concatenate(rows)
        r = e.forward([Step("ref", 1, np.array([pos]), np.array([r.next_token]), want_logits="all")])[0]
        rows.append(r.logits)
        pos += 1


def test_a_route_of_dgr_workers_generates_what_the_whole_model_does(cpp_route):
    with RouteClient(cpp_route, chunk_tokens=5) as c:
        gen = c.run(TEXT, max_new_tokens=16, logits="all", stop_token_ids=[])
    ids, rows = _whole_model(gen.prompt_ids, 16)
    assert gen.token_ids == ids
    assert sorted(gen.logits) == list(range(len(gen.prompt_ids) + 15))
    assert np.array_equal(np.stack([gen.logits[p] for p in sorted(gen.logits)]), rows)


def _whole_model_sampled(ids: list[int], n: int, lib: str, temperature: float, top_k: int, top_p: float,
                         seed: int) -> tuple[list[int], list[np.ndarray]]:
    """The whole model in this process, each token drawn from its row by the library's dgr_sample (the sampler
    dgr-worker calls), keyed by the row's position as the last stage keys it. Tokens and rows."""
    sampler = C.CDLL(lib).dgr_sample
    sampler.argtypes = [C.POINTER(C.c_float), C.c_int32, C.c_double, C.c_int32, C.c_double, C.c_uint64, C.c_int64]
    sampler.restype = C.c_int32
    e = FakeEngine(SPEC)
    e.open_session("ref", 1)
    r = e.forward([Step("ref", 1, np.arange(len(ids)), np.array(ids), want_logits="last")])[0]
    out, rows, pos = [], [], len(ids) - 1
    while True:
        row = np.ascontiguousarray(r.logits[-1], dtype=np.float32).copy()
        rows.append(row)
        tok = sampler(row.ctypes.data_as(C.POINTER(C.c_float)), row.size, temperature, top_k, top_p, seed, pos)
        assert tok >= 0
        out.append(int(tok))
        if len(out) == n:
            return out, rows
        pos += 1
        r = e.forward([Step("ref", 1, np.array([pos]), np.array([tok]), want_logits="last")])[0]


def test_sampled_generation_equals_the_whole_model_sampled_alike(cpp_route, fake_lib):
    sampling = dict(temperature=0.9, top_k=40, top_p=0.95, seed=7)
    kw = dict(max_new_tokens=20, stop_token_ids=[], logits="last", **sampling)
    with RouteClient(cpp_route) as c:
        a = c.run(TEXT, **kw)
        greedy = c.run(TEXT, max_new_tokens=20, stop_token_ids=[])
    tokens, rows = _whole_model_sampled(a.prompt_ids, 20, fake_lib, **sampling)
    assert a.token_ids == tokens and a.text == FakeEngine(SPEC).detokenize(tokens)
    n = len(a.prompt_ids)
    assert sorted(a.logits) == list(range(n - 1, n + 19))
    assert all(np.array_equal(a.logits[n - 1 + k], row) for k, row in enumerate(rows))
    assert a.token_ids != greedy.token_ids                       # sampled, not greedy
    assert greedy.token_ids == _whole_model(greedy.prompt_ids, 20)[0]


def test_describe_is_the_fake_stage_and_the_flags(worker_bin, fake_lib):
    a = cpp_fake(worker_bin, SPEC, 1, "--session-ttl", "123", "--max-queued-steps", "77")
    try:
        d = a.stub.Describe(pb.DescribeRequest(), timeout=10)
        model = FakeModel.from_spec(SPEC)
        info = FakeEngine(model, 1).describe()
        c = info.contract
        begin, end = model.ranges[1]
        assert (begin, end) == (c.layer_begin, c.layer_end) == (2, 5)
        ident = pb.Identity(model=f"fake:{model.to_spec()}", bundle_id=model.bundle_id, stage_index=1,
                                 stage_count=len(model.ranges), layer_begin=begin, layer_end=end, n_layer=model.layers,
                                 lane="cpu", arch=info.arch, numerics="fake/fp-contract-off")
        schema = dict(n_streams=c.n_streams, n_embd=c.n_embd, dtype=pb.F32, bundle_id=model.bundle_id)
        schema_out = pb.BoundarySchema(**schema, token_ids=True, layer=end)     # token ids always travel on
        want = dict(identity=ident, schema_in=pb.BoundarySchema(**schema, token_ids=c.token_ids_in, layer=begin),
                    schema_out=schema_out, has_vocab=info.has_vocab, n_vocab=info.n_vocab, n_ctx=info.n_ctx,
                    max_sessions=info.max_sessions, max_message_bytes=codec.DEFAULT_MAX_MESSAGE_BYTES,
                    seam_bytes_per_token=codec.seam_bytes_per_token(schema_out), engine="fake", eos_token_ids=[EOS],
                    session_ttl_s=123.0, max_queued_steps=77, can_roll_back=info.can_truncate,
                    batch_invariant=info.batch_invariant,
                    prefix_cache_off="the engine library predates it")     # the fake engine keeps no states
        assert c.token_ids_in and info.n_vocab == model.vocab
        got = {f.name: v for f, v in d.ListFields() if f.name != "descriptor_json"}
        assert got == want, {k: (got.get(k), want.get(k)) for k in got.keys() | want.keys() if got.get(k) != want.get(k)}
        j = json.loads(d.descriptor_json)
        assert j["address"] == a.address and j["identity"]["engine"] == "fake" and j["identity"]["wire_dtype"] == "f32"
        assert j["identity"]["engine_blake3"] == b3(Path(fake_lib))
    finally:
        a.stop()


def test_dgr_worker_refuses_a_bad_fake_spec_or_stage(worker_bin, fake_lib):
    for args, why in ((["--fake-engine", "layers=4,colour=blue", "--stage", "0"], "bad item 'colour=blue'"),
                      (["--fake-engine", SPEC, "--stage", "3"], "fake bundle has 3 stages; there is no stage 3"),
                      (["--fake-engine", SPEC, "--stage", "0", "--wire-dtype", "q8_0"], "packs 32 values per block"),
                      (["--fake-engine", SPEC, "--stage", "0", "--wire-dtype", "f8"], "unknown wire dtype 'f8'"),
                      (["--fake-engine", SPEC, "--bundle", "x", "--stage", "0"], "exactly one of")):
        done = subprocess.run([str(worker_bin), *args, "--listen", "127.0.0.1:0"], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode in (1, 2) and why in done.stderr, (args, done.stderr)


# --- ggml's wire-dtype converters (the fake's own C++, the real engine library's ggml)

CONVERTERS = ("ggml_fp16_to_fp32_row", "ggml_fp32_to_fp16_row", "ggml_bf16_to_fp32_row", "ggml_fp32_to_bf16_row_ref",
              "quantize_row_q8_0_ref", "dequantize_row_q8_0")
# ggml leaves q8_0's int8 cast undefined out of range (a block with a NaN or an infinity, or one whose scale
# 1/d overflows); the fake does what an x86 build of ggml does, so those blocks are compared there only
X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


class _Converters:
    def __init__(self, path):
        self.lib = C.CDLL(str(path))
        for name in CONVERTERS:
            f = getattr(self.lib, name)
            f.argtypes, f.restype = [C.c_void_p, C.c_void_p, C.c_int64], None

    def _call(self, name: str, x: np.ndarray, out_dtype, n_out: int, n: int) -> np.ndarray:
        x = np.ascontiguousarray(x)
        y = np.zeros(n_out, out_dtype)
        getattr(self.lib, name)(x.ctypes.data, y.ctypes.data, n)
        return y

    def run(self, f32: np.ndarray, u16: np.ndarray, q8_in: np.ndarray, blocks: np.ndarray) -> dict[str, np.ndarray]:
        """Every converter's output bits: f32 values narrowed, 16-bit patterns widened, q8_0 both ways."""
        nq, nb = q8_in.size, blocks.size // 34
        q = self._call("quantize_row_q8_0_ref", q8_in, np.uint8, nq // 32 * 34, nq)
        return {
            "f32->f16": self._call("ggml_fp32_to_fp16_row", f32, np.uint16, f32.size, f32.size),
            "f32->bf16": self._call("ggml_fp32_to_bf16_row_ref", f32, np.uint16, f32.size, f32.size),
            "f16->f32": self._call("ggml_fp16_to_fp32_row", u16, np.float32, u16.size, u16.size).view(np.uint32),
            "bf16->f32": self._call("ggml_bf16_to_fp32_row", u16, np.float32, u16.size, u16.size).view(np.uint32),
            "q8_0": q,
            "q8_0 back": self._call("dequantize_row_q8_0", q, np.float32, nq, nq).view(np.uint32),
            "q8_0 blocks back": self._call("dequantize_row_q8_0", blocks, np.float32, nb * 32, nb * 32).view(np.uint32),
        }


def _f32_cases(rng) -> np.ndarray:
    """float32 values that find a converter's every corner (as one array)."""
    bits = np.array([0x00000000, 0x80000000, 0x7F800000, 0xFF800000,                      # zeros, infinities
                     0x7FC00000, 0xFFC00000, 0x7FC00001, 0x7FFFFFFF, 0xFFFFFFFF,           # quiet NaNs
                     0x7F800001, 0xFF800001, 0x7FA00000, 0x7FBFFFFF,                       # signalling NaNs
                     0x7F7FFFFF, 0xFF7FFFFF, 0x00800000, 0x80800000,                       # max, min normal
                     0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF], np.uint32)           # subnormals' ends
    with np.errstate(over="ignore"):
        scales = 10.0 ** np.arange(-46, 40)
        normals = (rng.standard_normal((scales.size, 500)) * scales[:, None]).astype(np.float32).ravel()
    # f16 ties: the midpoint of every two neighbouring f16 values (subnormal, normal, 65504..65536), and one
    # float32 ulp either side of it
    h = np.arange(0x7C00, dtype=np.uint32)
    lo = h.astype(np.uint16).view(np.float16).astype(np.float64)
    hi = np.append(lo[1:], 65536.0)
    mid = ((lo + hi) / 2).astype(np.float32)
    f16_ties = np.concatenate([mid, np.nextafter(mid, np.float32(0)), np.nextafter(mid, np.float32(np.inf))])
    # bf16 ties: the low half 0x8000 exactly, and one either side
    k = rng.integers(0, 1 << 16, 20000, dtype=np.uint32)
    bf16_ties = np.concatenate([(k << 16) | d for d in (0x7FFF, 0x8000, 0x8001)]).astype(np.uint32).view(np.float32)
    f32_subnormals = (rng.integers(1, 1 << 23, 20000, dtype=np.uint32) | (rng.integers(0, 2, 20000, dtype=np.uint32) << 31))
    anything = rng.integers(0, 1 << 32, 200000, dtype=np.uint64).astype(np.uint32)
    out = np.concatenate([bits.view(np.float32), normals, f16_ties, -f16_ties, bf16_ties,
                          f32_subnormals.view(np.float32), anything.view(np.float32)])
    return out.astype(np.float32)


def _q8_0_cases(rng) -> np.ndarray:
    """Rows of q8_0 blocks (32 float32 values each; as one array): the blocks whose int8 cast ggml leaves
    undefined on x86 only."""
    blocks = [rng.standard_normal((200, 32)) * 10.0 ** rng.uniform(-37, 37, (200, 1)),   # every normal scale
              np.zeros((1, 32)), np.full((1, 32), -0.0), np.tile([0.0, -0.0], 16)[None],   # all-zero blocks
              np.concatenate([[-127.0], np.arange(-15.5, 15.5)])[None],                    # scale 1: ties at every step
              np.concatenate([[127.0], rng.integers(-126, 127, 31) + 0.5])[None],
              np.full((1, 32), 3.0e5), np.full((1, 32), np.finfo(np.float32).max),          # f16 scale an infinity
              np.full((1, 32), np.finfo(np.float32).min), np.full((1, 32), 65504.0),
              np.full((1, 32), 1.0), rng.standard_normal((1, 32)) * 1e-30]                  # f16 scale subnormal or 0
    edge = [rng.standard_normal((1, 32)) * s for s in (1e-45, 1e-42, 1e-40, 1e-39, 2e-39, 1e-38, 2e-38, 1e-37,
                                                        4e-37, 1e-36)]                      # 1/d overflows (some)
    for at in (0, 5, 31):
        for bad in (np.nan, np.inf, -np.inf):
            b = np.ones(32)
            b[at] = bad
            edge.append(b[None])
    b = np.concatenate([np.ones(5), [np.nan], np.full(26, 1e-3)])                           # NaN then smaller
    edge.append(b[None])
    if X86:
        blocks += edge
    with np.errstate(over="ignore"):
        return np.concatenate(blocks).astype(np.float32).ravel()


@pytest.mark.engine
def test_the_fake_librarys_converters_are_the_real_engine_librarys(engine_lib, fake_lib):
    """The six ggml converters dgr-worker resolves for the lossy wire dtypes: the fake library's (plain C++) give
    the real engine library's (ggml's) bits on corner cases and on every 16-bit pattern."""
    from dgr.core.paths import REPO_ROOT

    rng = np.random.default_rng(11)
    f32 = _f32_cases(rng)
    u16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    q8_in = _q8_0_cases(rng)
    raw = rng.integers(0, 256, (3000, 34), dtype=np.uint8)          # blocks as bytes: any scale, NaN and inf too
    scales = np.array([0x7C00, 0xFC00, 0x7E00, 0x7C01, 0x0001, 0x8000, 0x0000, 0x7BFF] * 8, np.uint16)
    raw[:64, :2] = scales.view(np.uint8).reshape(-1, 2)
    raw[:32, 2:] = 0                                                # 0 * inf, 0 * NaN
    want = _Converters(engine_lib).run(f32, u16, q8_in, raw.ravel())
    libs = {fake_lib}
    if all((REPO_ROOT / s).is_file() for s in fake_engine.sources(REPO_ROOT)):
        libs.add(str(fake_engine.build_library()))       # the -O2 build on demand too
    for lib in libs:
        got = _Converters(lib).run(f32, u16, q8_in, raw.ravel())
        for name, w in want.items():
            bad = np.nonzero(got[name] != w)[0]
            assert bad.size == 0, (lib, name, bad[:10], got[name][bad[:10]], w[bad[:10]])


# --- lossy wire dtypes: a route of dgr-workers (the fake's converters, ggml's) generates what the stages in
# process do with each seam's boundary converted by numpy (dgr.runtime.wire.codec)

SPEC_32 = "layers=7,embd=16,streams=2,cuts=2:5,hash_layers=3,seed=3"      # 32 values a token: q8_0 fits


def _route(cmds: list[list[str]]) -> list[Proc]:
    with ThreadPoolExecutor(len(cmds)) as ex:
        futures = [ex.submit(Proc, c) for c in cmds]
    procs, errors = [], []
    for f in futures:
        try:
            procs.append(f.result())
        except Exception as e:  # noqa: BLE001  (stop the others, then fail)
            errors.append(e)
    if errors:
        for p in procs:
            p.stop()
        raise errors[0]
    return procs


def _stages_over_the_wire(ids: list[int], n: int, spec: str, dtype: int) -> tuple[list[int], np.ndarray]:
    """Greedy generation on the model's stages in this process, each boundary encoded in `dtype` and decoded
    (dgr.runtime.wire.codec) at every seam: tokens, and the rows of every position."""
    model = FakeModel.from_spec(spec)
    stages = [FakeEngine(model, i) for i in range(len(model.ranges))]
    for e in stages:
        e.open_session("wire", 1)

    def forward(lo: int, tids: list[int]):
        pos, b = np.arange(lo, lo + len(tids)), None
        for e in stages:
            r = e.forward([Step("wire", 1, pos, np.array(tids), boundary=b, want_logits="all")])[0]
            b = None if r.boundary is None else codec.decode(codec.encode(r.boundary, dtype))
        return r

    r = forward(0, ids)
    rows, out = [r.logits], []
    while True:
        out.append(int(np.argmax(r.logits[-1])))
        if len(out) == n:
            return out, np.concatenate(rows)
        r = forward(len(ids) + len(out) - 1, [out[-1]])
        rows.append(r.logits)


@pytest.mark.parametrize("dtype", ["f16", "bf16", "q8_0"])
def test_dgr_worker_serves_lossy_wire_dtypes_as_numpy_converts_them(worker_bin, fake_lib, dtype):
    n = len(FakeModel.from_spec(SPEC_32).ranges)
    listen = ["--listen", "127.0.0.1:0", "--wire-dtype", dtype]
    procs = _route([[str(worker_bin), "--fake-engine", SPEC_32, "--stage", str(i), *listen] for i in range(n)])
    try:
        code = codec.DTYPES[dtype]
        for i, p in enumerate(procs):
            d = p.stub.Describe(pb.DescribeRequest(), timeout=10)
            if i < n - 1:
                assert d.schema_out.dtype == code
            if i:
                assert d.schema_in.dtype == code
        with RouteClient([p.address for p in procs], chunk_tokens=5) as c:
            gen = c.run(TEXT, max_new_tokens=12, logits="all", stop_token_ids=[])
        assert len(gen.token_ids) == 12
        tokens, rows = _stages_over_the_wire(gen.prompt_ids, 12, SPEC_32, code)
        assert gen.token_ids == tokens and gen.text == FakeEngine(SPEC_32).detokenize(tokens)
        assert sorted(gen.logits) == list(range(len(rows)))
        got = np.stack([gen.logits[p] for p in sorted(gen.logits)])
        assert np.array_equal(got, rows), np.max(np.abs(got - rows))
        # lossy: not the f32 route's logits (the dtype did cross the seams)
        _, f32_rows = _whole_model(gen.prompt_ids, 12, SPEC_32)
        assert not np.array_equal(got, f32_rows)
    finally:
        for p in procs:
            print(p.stop()[-2000:])
