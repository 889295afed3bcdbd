"""Boundaries and schemas on the wire: numpy <-> dgr.v1 messages, wire dtypes, message-size budgets."""

from __future__ import annotations

import math

import numpy as np

from dgr.contract import WIRE_DTYPES, BoundarySchema
from dgr.errors import WireError
from dgr.wire.gen import stage_pb2 as pb

# From the one table of wire dtypes (dgr.contract): the proto enum names them in upper case. Bytes are
# per value: every dtype the codec encodes packs one value per block.
DTYPES = {name: pb.Dtype.Value(name.upper()) for name in WIRE_DTYPES}
DTYPE_NAMES = {code: name for name, code in DTYPES.items()}
DTYPE_BYTES = {DTYPES[name]: d.nbytes(1) for name, d in WIRE_DTYPES.items()}

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


def encode(x: np.ndarray, dtype: int) -> pb.Boundary:
    """float32 [n, streams, embd] -> Boundary in the wire dtype (bf16 rounds to nearest even)."""
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
    else:
        raise WireError(f"cannot encode wire dtype {dtype}")
    return pb.Boundary(dtype=dtype, shape=list(x.shape), data=data)


def decode(b: pb.Boundary) -> np.ndarray:
    """Boundary -> float32 array of its shape; raises ValueError on a size/dtype mismatch."""
    if b.dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown boundary dtype {b.dtype}")
    shape = tuple(b.shape)
    n = math.prod(shape) if shape else 0            # exact: np.prod wraps around on 2**64
    if len(b.data) != n * DTYPE_BYTES[b.dtype]:
        raise ValueError(f"boundary of shape {list(shape)} in {DTYPE_NAMES[b.dtype]} needs "
                         f"{n * DTYPE_BYTES[b.dtype]} bytes, got {len(b.data)}")
    if b.dtype == pb.F32:
        return np.frombuffer(b.data, dtype="<f4").astype(np.float32).reshape(shape)
    if b.dtype == pb.F16:
        return np.frombuffer(b.data, dtype="<f2").astype(np.float32).reshape(shape)
    u = np.frombuffer(b.data, dtype="<u2").astype(np.uint32) << 16
    return u.view(np.float32).reshape(shape)


def seam_bytes_per_token(schema: pb.BoundarySchema) -> int:
    return schema.n_streams * schema.n_embd * DTYPE_BYTES.get(schema.dtype, 4)


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
