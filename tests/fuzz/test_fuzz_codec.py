"""Property tests (hypothesis) of the frame codec (round trips per wire dtype, decode of any Boundary, schema_diff,
tokens_per_frame) and of dgr-worker's frame checks (any frame is refused with a typed error or is well formed)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from dgr.app.local import FakeRoute
from dgr.core.errors import WireError
from dgr.runtime.wire import codec
from dgr.runtime.wire.client import RouteClient
from dgr.runtime.wire.gen import stage_pb2 as pb

from support.wire import open_on

SPEC = "layers=6,embd=16,cuts=2:4,hash_layers=3,seed=8"
FAST = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
shapes = hnp.array_shapes(min_dims=3, max_dims=3, min_side=0, max_side=6)
floats32 = st.floats(width=32, allow_nan=True, allow_infinity=True)


def _bf16_ref(x: np.ndarray) -> np.ndarray:
    """Round to nearest even on the top 16 bits, in Python integers (the reference)."""
    out = []
    for v in x.ravel().tolist():
        u = int(np.float32(v).view(np.uint32))
        if math.isnan(v):
            out.append(float("nan"))
            continue
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        out.append(float(np.uint32(r << 16).view(np.float32)))
    return np.array(out, np.float32).reshape(x.shape)


@FAST
@given(hnp.arrays(np.float32, shapes, elements=floats32))
def test_round_trips_per_wire_dtype(x):
    f32 = codec.decode(codec.encode(x, pb.F32))
    assert f32.shape == x.shape and f32.dtype == np.float32
    assert np.array_equal(f32, x, equal_nan=True) and np.array_equal(np.signbit(f32), np.signbit(x))
    with np.errstate(over="ignore"):
        want16 = x.astype(np.float16).astype(np.float32)
    assert np.array_equal(codec.decode(codec.encode(x, pb.F16)), want16, equal_nan=True)
    bf = codec.decode(codec.encode(x, pb.BF16))
    assert bf.shape == x.shape
    assert np.array_equal(bf, _bf16_ref(x), equal_nan=True)
    assert np.array_equal(np.isnan(bf), np.isnan(x))          # a NaN stays a NaN, never an infinity
    fin = np.isfinite(x) & np.isfinite(bf) & (np.abs(x) > 1e-30)
    assert np.all(np.abs(bf[fin] - x[fin]) <= np.abs(x[fin]) * 2.0**-8)


@FAST
@given(st.integers(-2**31, 2**31 - 1).filter(lambda d: d not in codec.DTYPE_BYTES))
def test_encode_refuses_unknown_dtypes(d):
    with pytest.raises(WireError):
        codec.encode(np.zeros((1, 1, 1), np.float32), d)


boundaries = st.builds(
    lambda dtype, shape, data: pb.Boundary(dtype=dtype, shape=shape, data=data),
    st.one_of(st.sampled_from(sorted(codec.DTYPE_BYTES)), st.integers(-2**31, 2**31 - 1)),
    st.one_of(st.lists(st.integers(0, 8), max_size=5), st.lists(st.integers(0, 2**32 - 1), max_size=5)),
    st.binary(max_size=256))


@FAST
@given(boundaries)
def test_decode_of_any_boundary_is_an_array_of_its_shape_or_a_value_error(b):
    try:
        x = codec.decode(b)
    except ValueError:
        return
    assert isinstance(x, np.ndarray) and x.dtype == np.float32 and x.shape == tuple(b.shape)
    assert len(b.data) == codec.boundary_nbytes(b.dtype, x.size)


@FAST
@given(st.sampled_from(sorted(codec.DTYPE_BYTES)), st.lists(st.integers(0, 5), min_size=1, max_size=4),
       st.data())
def test_decode_of_a_consistent_boundary_always_succeeds(dtype, shape, data):
    raw = data.draw(st.binary(min_size=math.prod(shape) * codec.DTYPE_BYTES[dtype],
                              max_size=math.prod(shape) * codec.DTYPE_BYTES[dtype]))
    assert codec.decode(pb.Boundary(dtype=dtype, shape=shape, data=raw)).shape == tuple(shape)


def test_decode_of_a_shape_whose_product_wraps_around_is_refused():
    # (2**32 - 1)**2 * 2**... : numpy's int64 product would wrap to a small number
    b = pb.Boundary(dtype=pb.F32, shape=[2**32 - 1, 2**32 - 1, 2**32 - 1], data=b"")
    with pytest.raises(ValueError):
        codec.decode(b)
    b = pb.Boundary(dtype=pb.F32, shape=[2**16, 2**16, 2**16, 2**16], data=b"")   # 2**64: int64 wraps to 0
    with pytest.raises(ValueError):
        codec.decode(b)


schemas = st.builds(pb.BoundarySchema, n_streams=st.integers(0, 4), n_embd=st.integers(0, 2**32 - 1),
                    dtype=st.sampled_from(sorted(codec.DTYPE_BYTES)), token_ids=st.booleans(),
                    bundle_id=st.sampled_from(["", "a", "b"]), layer=st.integers(0, 2**32 - 1))


@FAST
@given(schemas, schemas)
def test_schema_diff_names_exactly_the_differing_fields(a, b):
    d = codec.schema_diff(a, b)
    assert d == [f for f in ("n_streams", "n_embd", "dtype", "bundle_id") if getattr(a, f) != getattr(b, f)]
    assert sorted(d) == sorted(codec.schema_diff(b, a)) and codec.schema_diff(a, a) == []
    c = pb.BoundarySchema()
    c.CopyFrom(a)
    c.layer, c.token_ids = b.layer, b.token_ids                # neither is a schema difference
    assert codec.schema_diff(a, c) == []


@FAST
@given(st.integers(0, 2**40), st.integers(0, 2**32))
def test_tokens_per_frame_is_the_most_that_fit(limit, per_token):
    per = per_token + codec.PER_TOKEN_IDS
    try:
        n = codec.tokens_per_frame(limit, per_token)
    except WireError as e:
        assert limit - codec.FRAME_OVERHEAD < per and "--max-message-bytes" in str(e)
        return
    assert n >= 1 and n * per + codec.FRAME_OVERHEAD <= limit < (n + 1) * per + codec.FRAME_OVERHEAD


# ---------------------------------------------------------------------------------------------- frame checks


@pytest.fixture(scope="module")
def stage1():
    """Stage 1 of a fake route of dgr-workers, with session ("prop", 1) open on it as stage 0 would open it."""
    import grpc

    from dgr.runtime.wire.gen import stage_pb2_grpc as pb_grpc

    with FakeRoute.of(SPEC) as r:
        descs = RouteClient(r.addresses).describe()
        with grpc.insecure_channel(r.addresses[1]) as ch:
            stub = pb_grpc.StageStub(ch)
            assert not open_on(stub, r.addresses, 1, descs, "prop", 1).HasField("error")
            yield stub, descs[1]


def _replies(stub, frame: pb.Frame, probe: pb.Frame) -> list[pb.Frame]:
    """Send `frame`, then `probe` (refused at once), on a new Frames stream; the replies that came before the
    probe's. A new stream each time: a late engine error about an earlier frame goes to that frame's stream."""
    call = stub.Frames(iter([frame, probe]), timeout=30)
    got = []
    try:
        for reply in call:
            if reply.session_id == probe.session_id:
                return got
            got.append(reply)
    finally:
        call.cancel()
    raise AssertionError(f"the stream ended before the probe was answered (replies so far: {got}); frame: {frame}")


def _frames(want: pb.BoundarySchema, ns: int, ne: int):
    other = st.builds(lambda f, v: (f, v), st.sampled_from(["n_streams", "n_embd", "dtype", "bundle_id", "layer"]),
                      st.integers(1, 3))

    @st.composite
    def build(draw):
        n = draw(st.integers(0, 4))
        p0 = draw(st.sampled_from([0, 0, 0, 1, 2**31 - 5]))
        f = pb.Frame(session_id=draw(st.sampled_from(["prop"] * 10 + ["nobody", ""])),
                     epoch=draw(st.sampled_from([1] * 10 + [0, 2, 2**64 - 1])))
        kind = draw(st.sampled_from(["step"] * 6 + ["generate", "none"]))
        if kind == "generate":
            f.generate.max_new_tokens = 3
            return f
        if kind == "none":
            return f
        s = f.step
        s.positions[:] = draw(st.one_of(st.just(list(range(p0, p0 + n))),
                                        st.lists(st.integers(-2**31, 2**31 - 1), max_size=4)))
        s.cache_expect = draw(st.sampled_from([p0, p0, p0 + 1, 2**64 - 1]))
        s.token_ids[:] = draw(st.one_of(st.just([7] * len(s.positions)), st.lists(st.integers(0, 100), max_size=5)))
        s.schema.CopyFrom(want)
        if draw(st.integers(0, 4)) == 0:
            field, dv = draw(other)
            if field == "bundle_id":
                s.schema.bundle_id += "x"
            else:
                setattr(s.schema, field, getattr(s.schema, field) + dv)
        if draw(st.integers(0, 9)) == 0:
            s.ClearField("schema")
        m = len(s.positions)
        shape = draw(st.one_of(st.just([m, ns, ne]), st.lists(st.integers(0, 20), max_size=4)))
        dtype = draw(st.sampled_from([want.dtype] * 4 + [pb.F32, pb.F16, pb.BF16, 0, 77]))
        size = math.prod(shape) * codec.DTYPE_BYTES.get(dtype, 4) if shape else 0
        data = draw(st.one_of(st.just(b"\0" * size), st.binary(max_size=64)))
        if draw(st.integers(0, 9)):
            s.boundary.CopyFrom(pb.Boundary(dtype=dtype, shape=shape, data=data))
        return f

    return build()


def _well_formed(f: pb.Frame, want: pb.BoundarySchema, ns: int, ne: int, n_ctx: int) -> bool:
    if (f.session_id, f.epoch) != ("prop", 1) or f.WhichOneof("body") != "step":
        return False
    s = f.step
    n = len(s.positions)
    if n == 0 or list(s.positions) != list(range(s.positions[0], s.positions[0] + n)):
        return False
    if s.cache_expect != s.positions[0] or s.positions[0] + n > n_ctx:
        return False
    if not s.HasField("schema") or codec.schema_diff(s.schema, want) or s.schema.layer != want.layer:
        return False
    b = s.boundary
    return (len(s.token_ids) == n and list(b.shape) == [n, ns, ne] and b.dtype == want.dtype
            and len(b.data) == n * ns * ne * codec.DTYPE_BYTES[want.dtype])


def test_frame_checks_refuse_every_malformed_frame_with_a_typed_error(stage1):
    stub, desc = stage1
    want = desc.schema_in
    ns, ne = want.n_streams, want.n_embd
    codes = set(pb.ErrorCode.values()) - {0}
    seen: dict[str, int] = {}
    # a frame of a session nobody opened: refused at once, whatever came before it on the stream
    probe = pb.Frame(session_id="probe", epoch=1, step=pb.Step(
        positions=[0], token_ids=[7], cache_expect=0, schema=want,
        boundary=codec.encode(np.zeros((1, ns, ne), np.float32), want.dtype)))

    @settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(_frames(want, ns, ne))
    def check(frame):
        replies = _replies(stub, frame, probe)        # what dgr-worker answers to the frame it reads
        ok = _well_formed(frame, want, ns, ne, desc.n_ctx)
        if ok:
            seen["accepted"] = seen.get("accepted", 0) + 1
            # a well-formed step can only be refused later, by the engine (CACHE_MISS) or the queue bound
            assert all(r.error.code in (pb.CACHE_MISS, pb.OVERLOADED, pb.ENGINE) for r in replies), replies
            return
        assert replies, f"a malformed frame was not refused: {frame}"
        reply = replies[0]
        assert reply.WhichOneof("body") == "error", frame
        assert reply.error.code in codes and reply.error.hop.startswith("stage 1 ("), reply
        assert reply.error.message
        name = pb.ErrorCode.Name(reply.error.code)
        seen[name] = seen.get(name, 0) + 1

    check()
    print("\nframe checks:", seen)
    assert {"BAD_FRAME", "SCHEMA_MISMATCH", "UNKNOWN_SESSION"} <= set(seen)
