"""The stage contract, once in Python: a half-open layer range, the boundary schema that crosses each
seam, the wire dtypes, and the rule for the token-id sideband. The manifest, the engine binding, the
worker and the proto mapping all use these. The C++ side states the rules in worker/engine/dgr_contract.h;
its wire dtype table (worker/server/wire_constants.h) is generated from WIRE_DTYPES (dgr.toolchain.cppgen).

A boundary is float32 `[n_tokens, n_streams, n_embd]` inside an engine (n_streams is 1 for a plain
residual stream, hc_mult = 4 for DeepSeek V4's mHC) and `dtype` on the wire.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from dgr.core.errors import WireError

STRICT = ConfigDict(extra="forbid", strict=True, frozen=True)


@dataclass(frozen=True)
class WireDtype:
    """How a boundary value is carried: `block_bytes` bytes for every `block` values."""

    name: str
    block: int
    block_bytes: int
    lossless: bool

    def fits(self, n_values: int) -> bool:
        """Whether a boundary of `n_values` values per token packs into whole blocks (a block never
        straddles two tokens: a step's frames are cut between tokens)."""
        return n_values % self.block == 0

    def check(self, n_values: int) -> None:
        """ValueError, saying what to use instead, when `n_values` per token do not fill whole blocks."""
        if not self.fits(n_values):
            others = ", ".join(d.name for d in WIRE_DTYPES.values() if d.fits(n_values))
            raise ValueError(f"wire dtype {self.name} packs {self.block} values per block, but this boundary has "
                             f"{n_values} values per token (not a multiple of {self.block}); use {others}")

    def nbytes(self, n_values: int) -> int:
        self.check(n_values)
        return n_values // self.block * self.block_bytes


# The one table of wire dtypes (proto/dgr/v1/stage.proto's enum names these in upper case; dgr-worker's copy is
# generated from it: `dgr wire protoc`). Adding one: docs/wire.md, "Adding a wire field or dtype". q8_0 is
# ggml's Q8_0 block: an f16 scale d = max|x| / 127, then 32 int8 q = round(x / d); x' = q * d.
WIRE_DTYPES: dict[str, WireDtype] = {d.name: d for d in (
    WireDtype("f32", 1, 4, True),
    WireDtype("f16", 1, 2, False),
    WireDtype("bf16", 1, 2, False),
    WireDtype("q8_0", 32, 34, False),
)}
DEFAULT_WIRE_DTYPE = "f32"


def wire_dtype(name: str) -> WireDtype:
    """The wire dtype called `name`; ValueError naming the valid ones otherwise."""
    try:
        return WIRE_DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown wire dtype {name!r}; use one of {', '.join(WIRE_DTYPES)}") from None


def needs_token_ids(layer_begin: int, n_hash_layers: int) -> bool:
    """The sideband rule: a stage needs the token ids beside the residual when it is not the first
    (the first reads them anyway) and its range starts inside the leading token-routed layers
    (DeepSeek V4's hash layers). Only the range's first layer matters: a range is contiguous, so it
    holds a hash layer exactly when it starts before the last of them."""
    return 0 < layer_begin < n_hash_layers


class BoundarySchema(BaseModel):
    """What crosses one seam: the residual [n_tokens, n_streams, n_embd] in `dtype`, and whether the
    token-id sideband travels with it."""

    model_config = STRICT
    n_streams: int
    n_embd: int
    dtype: str
    token_ids: bool

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, v: str) -> str:
        wire_dtype(v)
        return v

    @field_validator("n_streams", "n_embd")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v <= 0:
            raise ValueError(f"must be positive, got {v}")
        return v

    @property
    def values_per_token(self) -> int:
        return self.n_streams * self.n_embd

    @property
    def bytes_per_token(self) -> int:
        """Wire bytes of one token's boundary (the seam cost), without ids and positions."""
        return wire_dtype(self.dtype).nbytes(self.values_per_token)

    def describe(self) -> str:
        return f"[n, {self.n_streams}, {self.n_embd}] {self.dtype}" + (" +token ids" if self.token_ids else "")


class StageContract(BaseModel):
    """One stage: layers [layer_begin, layer_end) of n_layer, and what it takes and gives at its seams.

    `token_ids_in`: this stage needs the sideband (`needs_token_ids`); `token_ids_out`: the stage after
    it does. Built with `StageContract.plan(...)` where the model's hash-layer count is known (bundle
    builds), or from an engine's own description."""

    model_config = STRICT
    layer_begin: int
    layer_end: int
    n_layer: int
    n_streams: int
    n_embd: int
    dtype: str = DEFAULT_WIRE_DTYPE
    token_ids_in: bool = False
    token_ids_out: bool = False

    @model_validator(mode="after")
    def _check(self) -> "StageContract":
        if not 0 <= self.layer_begin < self.layer_end <= self.n_layer:
            raise ValueError(f"layer range [{self.layer_begin}, {self.layer_end}) is not a non-empty part of "
                             f"[0, {self.n_layer})")
        if self.token_ids_in and self.layer_begin == 0:
            raise ValueError("the first stage reads token ids itself; it takes no sideband")
        if self.token_ids_out and self.layer_end == self.n_layer:
            raise ValueError("the last stage sends no boundary, so no sideband")
        wire_dtype(self.dtype).check(self.n_streams * self.n_embd)
        return self

    @classmethod
    def plan(cls, layer_begin: int, layer_end: int, n_layer: int, *, n_streams: int, n_embd: int,
             n_hash_layers: int = 0, dtype: str = DEFAULT_WIRE_DTYPE) -> "StageContract":
        """The contract of a stage owning [layer_begin, layer_end), the sideband rule applied at both seams."""
        return cls(layer_begin=layer_begin, layer_end=layer_end, n_layer=n_layer, n_streams=n_streams,
                   n_embd=n_embd, dtype=dtype, token_ids_in=needs_token_ids(layer_begin, n_hash_layers),
                   token_ids_out=layer_end < n_layer and needs_token_ids(layer_end, n_hash_layers))

    @property
    def is_first(self) -> bool:
        return self.layer_begin == 0

    @property
    def is_last(self) -> bool:
        return self.layer_end == self.n_layer

    @property
    def range(self) -> tuple[int, int]:
        return (self.layer_begin, self.layer_end)

    def _schema(self, token_ids: bool) -> BoundarySchema:
        return BoundarySchema(n_streams=self.n_streams, n_embd=self.n_embd, dtype=self.dtype, token_ids=token_ids)

    @property
    def boundary_in(self) -> BoundarySchema | None:
        """What this stage takes (None on the first stage: it takes token ids)."""
        return None if self.is_first else self._schema(self.token_ids_in)

    @property
    def boundary_out(self) -> BoundarySchema | None:
        """What this stage gives (None on the last stage: it gives logits)."""
        return None if self.is_last else self._schema(self.token_ids_out)

    def with_dtype(self, dtype: str) -> "StageContract":
        """This contract in wire dtype `dtype` (what a worker's --wire-dtype chooses); WireError when the
        boundary does not fill that dtype's blocks (model_copy runs no validator: checked here)."""
        d = wire_dtype(dtype)
        try:
            d.check(self.n_streams * self.n_embd)
        except ValueError as e:
            raise WireError(f"--wire-dtype {d.name}: {e}") from None
        return self.model_copy(update={"dtype": d.name})

    def describe(self) -> str:
        return f"layers [{self.layer_begin}, {self.layer_end}) of {self.n_layer}"
