"""Boundaries and schemas on the wire: numpy <-> dgr.v1 messages, wire dtypes, message-size budgets."""

from __future__ import annotations

import math

import numpy as np

from dgr.core.contract import WIRE_DTYPES, BoundarySchema
from dgr.core.errors import WireError
from dgr.runtime.wire.gen import stage_pb2 as pb

# From the one table of wire dtypes (dgr.core.contract): the proto enum names them in upper case.
DTYPES = {name: pb.Dtype.Value(name.upper()) for name in WIRE_DTYPES}
DTYPE_NAMES = {code: name for name, code in DTYPES.items()}
# Bytes per value of the dtypes that carry one value per block (f32, f16, bf16); a block dtype (q8_0)
# has no per-value size: `boundary_nbytes` sizes any of them.
DTYPE_BYTES = {DTYPES[name]: d.block_bytes for name, d in WIRE_DTYPES.items() if d.block == 1}
_BY_CODE = {DTYPES[name]: d for name, d in WIRE_DTYPES.items()}

Q8_BLOCK = WIRE_DTYPES["q8_0"].block                # 32 values: an f16 scale, then 32 int8
Q8_BLOCK_BYTES = WIRE_DTYPES["q8_0"].block_bytes    # 34

# Room kept in every frame for everything but the boundary payload and the per-token ids/positions
# (session id, schema, timings, protobuf tags). Generous: a frame's real size is also checked on send.
FRAME_OVERHEAD = 4096
# Per-token bytes besides the boundary: a position and a token id, each at most a 5-byte varint.
PER_TOKEN_IDS = 10

DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024 - 64 * 1024  # under gRPC's 4 MiB default with a margin


def dtype_code(name: str) -> int:
    try:
        return DTYPES[name]
    except KeyError:
        raise WireError(f"unknown wire dtype {name!r}; use one of {', '.join(DTYPES)}") from None


def schema_msg(schema: BoundarySchema, bundle_id: str, layer: int) -> pb.BoundarySchema:
    """The proto of what crosses the seam at `layer` of bundle `bundle_id`."""
    return pb.BoundarySchema(n_streams=schema.n_streams, n_embd=schema.n_embd, dtype=dtype_code(schema.dtype),
                             token_ids=schema.token_ids, bundle_id=bundle_id, layer=layer)


def boundary_nbytes(dtype: int, n_values: int) -> int:
    """Bytes of `n_values` values in wire dtype `dtype` (ValueError: unknown, or not whole blocks)."""
    if dtype not in _BY_CODE:
        raise ValueError(f"unknown boundary dtype {dtype}")
    return _BY_CODE[dtype].nbytes(n_values)


def _q8_0_encode(x: np.ndarray) -> bytes:
    """ggml's quantize_row_q8_0_ref, vectorised: per block of 32, d = amax / 127 and q = roundf(x * (1 / d))
    in float32 (halves away from zero), the scale stored as f16 (nearest even). ggml leaves non-finite
    input undefined; here a block holding a NaN or an infinity comes back as NaN throughout."""
    b = x.reshape(-1, Q8_BLOCK)
    with np.errstate(all="ignore"):
        amax = np.max(np.abs(b), axis=1)                # a NaN anywhere in a block propagates
        d = amax / np.float32(127)
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
        v = b * inv[:, None]
        t = np.trunc(v)
        r = t + np.where(np.abs(v - t) >= 0.5, np.sign(v), 0)     # roundf; v - t is exact in float32
        # a block of subnormals overflows 1 / d: ggml's int8 cast of an infinity gives 0 on x86 (its scale
        # is 0 in f16 anyway); nothing else leaves [-127, 127]
        q = np.clip(np.where(np.isfinite(r), r, 0), -127, 127).astype(np.int8)
        scale = d.astype("<f2")                         # beyond f16's range: an infinity, as ggml's cast
    bad = ~np.isfinite(amax)
    q[bad] = 0
    scale[bad] = np.nan
    out = np.empty((b.shape[0], Q8_BLOCK_BYTES), np.uint8)
    out[:, :2] = scale.view(np.uint8).reshape(-1, 2)
    out[:, 2:] = q.view(np.uint8)
    return out.tobytes()


def _q8_0_decode(data: bytes, shape: tuple[int, ...]) -> np.ndarray:
    """ggml's dequantize_row_q8_0: x = q * d, d the block's f16 scale widened to float32."""
    blocks = np.frombuffer(data, dtype=np.uint8).reshape(-1, Q8_BLOCK_BYTES)
    d = np.ascontiguousarray(blocks[:, :2]).view("<f2").astype(np.float32)
    q = blocks[:, 2:].view(np.int8).astype(np.float32)
    with np.errstate(invalid="ignore"):                 # 0 * inf in a block a peer scaled to infinity
        return (q * d).reshape(shape)


def encode(x: np.ndarray, dtype: int) -> pb.Boundary:
    """float32 [n, streams, embd] -> Boundary in the wire dtype (bf16 rounds to nearest even; q8_0 in
    blocks of 32 values of one token, as ggml's Q8_0)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if dtype == pb.F32:
        data = x.astype("<f4", copy=False).tobytes()
    elif dtype == pb.F16:
        with np.errstate(over="ignore"):             # beyond f16's range is an infinity, as in a cast
            data = x.astype("<f2").tobytes()
    elif dtype == pb.BF16:
        u = x.view(np.uint32).astype(np.uint64)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        # a NaN whose payload is all in the low half would round to infinity: keep it a (quiet) NaN
        r = np.where(np.isnan(x).reshape(r.shape), (u >> 16) | 0x0040, r)
        data = r.astype("<u2").tobytes()
    elif dtype == pb.Q8_0:
        per_token = math.prod(x.shape[1:]) if x.ndim > 1 else x.size
        if per_token % Q8_BLOCK:
            raise WireError(f"wire dtype q8_0 packs {Q8_BLOCK} values of one token per block; this boundary "
                            f"{list(x.shape)} has {per_token} values per token: use f32, f16 or bf16")
        data = _q8_0_encode(x)
    else:
        raise WireError(f"cannot encode wire dtype {dtype}")
    return pb.Boundary(dtype=dtype, shape=list(x.shape), data=data)


def decode(b: pb.Boundary) -> np.ndarray:
    """Boundary -> float32 array of its shape; raises ValueError on a size/dtype mismatch."""
    if b.dtype not in _BY_CODE:
        raise ValueError(f"unknown boundary dtype {b.dtype}")
    shape = tuple(b.shape)
    n = math.prod(shape) if shape else 0            # exact: np.prod wraps around on 2**64
    if b.dtype == pb.Q8_0 and len(shape) > 1 and math.prod(shape[1:]) % Q8_BLOCK:
        raise ValueError(f"boundary of shape {list(shape)} in q8_0: {math.prod(shape[1:])} values per token "
                         f"do not fill whole blocks of {Q8_BLOCK}")
    want = boundary_nbytes(b.dtype, n)              # ValueError for q8_0 when n is not whole blocks
    if len(b.data) != want:
        raise ValueError(f"boundary of shape {list(shape)} in {DTYPE_NAMES[b.dtype]} needs "
                         f"{want} bytes, got {len(b.data)}")
    if b.dtype == pb.F32:
        return np.frombuffer(b.data, dtype="<f4").astype(np.float32).reshape(shape)
    if b.dtype == pb.F16:
        return np.frombuffer(b.data, dtype="<f2").astype(np.float32).reshape(shape)
    if b.dtype == pb.Q8_0:
        return _q8_0_decode(b.data, shape)
    u = np.frombuffer(b.data, dtype="<u2").astype(np.uint32) << 16
    return u.view(np.float32).reshape(shape)


def seam_bytes_per_token(schema: pb.BoundarySchema) -> int:
    """Wire bytes of one token's boundary at this seam (f32's for a dtype this side does not know)."""
    n = schema.n_streams * schema.n_embd
    return boundary_nbytes(schema.dtype if schema.dtype in _BY_CODE else pb.F32, n)


def tokens_per_frame(max_message_bytes: int, bytes_per_token: int) -> int:
    """How many tokens of a step fit one frame under the limit (at least one, else WireError)."""
    per = bytes_per_token + PER_TOKEN_IDS
    n = (max_message_bytes - FRAME_OVERHEAD) // per
    if n < 1:
        raise WireError(f"one token needs {per + FRAME_OVERHEAD} bytes per frame but the message limit "
                        f"is {max_message_bytes}: raise --max-message-bytes")
    return int(n)


def schema_str(s: pb.BoundarySchema) -> str:
    return (f"[n, {s.n_streams}, {s.n_embd}] {DTYPE_NAMES.get(s.dtype, s.dtype)} at layer {s.layer}"
            f"{' +token ids' if s.token_ids else ''} of bundle {s.bundle_id}")


def schema_diff(got: pb.BoundarySchema, want: pb.BoundarySchema) -> list[str]:
    """Names of the fields in which two schemas differ. Excluded: layer (a range question) and token_ids
    (the sender says it provides ids, the receiver that it needs them; checked apart)."""
    return [f for f in ("n_streams", "n_embd", "dtype", "bundle_id")
            if getattr(got, f) != getattr(want, f)]


def hop_name(index: int, address: str) -> str:
    return f"stage {index} ({address})"
