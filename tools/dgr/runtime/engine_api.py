"""The ShardEngine protocol: what a worker needs from an engine, real (`dgr.runtime.engine`, ctypes over
worker/engine's C ABI) or fake (`dgr.testing.fake_engine`, numpy, for protocol tests).

Shapes: a boundary is float32 `[n_tokens, n_streams, n_embd]` (n_streams is 1 for plain residual
streams, hc_mult=4 for DeepSeek V4's mHC). Layer ranges are half-open `[begin, end)` in the model's
global numbering. A session is keyed by (session_id, epoch); its cache holds positions `0..n_cached-1`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from dgr.core.contract import StageContract


@dataclass(frozen=True)
class StageInfo:
    """What an engine says about itself: its stage contract (range, n_layer, boundary facts; dtype "f32",
    the engine's own) and the rest of what a worker needs to serve it."""

    arch: str
    contract: StageContract
    n_vocab: int
    has_vocab: bool         # can tokenize/detokenize (every stage file keeps the tokenizer metadata)
    n_ctx: int              # positions a session may hold
    max_sessions: int
    # can drop a session's cached positions from a point on (`ShardEngine.truncate`): what speculative
    # decoding needs to roll back rejected drafts; False for recurrent/hybrid models (one running state)
    can_truncate: bool = True
    # a session's results do not depend on the batch: not on the sessions that share its forwards, nor on
    # how its own tokens are cut into prefill chunks, decode steps or verification steps (CPU, exact)
    batch_invariant: bool = True
    # the kernel each weight type of the stage's matrices takes on the CPU, "TYPES: kernel; ...": under the
    # invariant kernels, which run a fast kernel and which fall back to the reference vec_dot (docs/batching.md)
    matmul_kernels: str = ""

    # The contract's facts, read-only, under the names callers have always used.
    @property
    def layer_begin(self) -> int:
        return self.contract.layer_begin

    @property
    def layer_end(self) -> int:
        """Exclusive."""
        return self.contract.layer_end

    @property
    def n_layer(self) -> int:
        """Total layers of the whole model."""
        return self.contract.n_layer

    @property
    def n_embd(self) -> int:
        return self.contract.n_embd

    @property
    def n_streams(self) -> int:
        """Residual streams crossing the seam (1, or 4 for V4 mHC)."""
        return self.contract.n_streams

    @property
    def is_first(self) -> bool:
        """Takes token ids and looks up embeddings."""
        return self.contract.is_first

    @property
    def is_last(self) -> bool:
        """Applies output norm + head, returns logits."""
        return self.contract.is_last

    @property
    def needs_token_ids(self) -> bool:
        """A non-first stage that needs the token-id sideband (V4 hash layers)."""
        return self.contract.token_ids_in

    @property
    def boundary_shape_per_token(self) -> tuple[int, int]:
        return (self.n_streams, self.n_embd)


@dataclass(frozen=True)
class VocabInfo:
    """A vocabulary's special tokens as llama.cpp sees them (`dgr_vocab_read`, `Engine.vocab()`). Ids are
    None where the vocabulary has none."""

    n_vocab: int
    bos: int | None
    eos: int | None
    eot: int | None          # end of turn (tokenizer.ggml.eot_token_id, or a known end-of-turn text)
    # every id that ends a generation (llama_vocab_is_eog): eos, eot, eom, fim pad/rep/sep and the known
    # end-of-turn texts (<|im_end|>, <end_of_turn>, <|eot_id|>, ...), ascending
    eog: tuple[int, ...] = ()

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The ids a generation stops at, the eos first (what a stage identity's eos_token_ids carries:
        a gateway takes the first as the template's eos_token), then the other end-of-generation ids."""
        head = () if self.eos is None else (self.eos,)
        return head + tuple(t for t in self.eog if t != self.eos)


@dataclass
class Step:
    """One session's slice of a forward batch."""

    session_id: str
    epoch: int
    positions: np.ndarray                    # int32 [n], must continue the session's cache exactly
    token_ids: np.ndarray | None = None      # int32 [n]: required on the first stage and where needs_token_ids
    boundary: np.ndarray | None = None       # float32 [n, n_streams, n_embd]: required unless is_first
    want_logits: str = "last"                # last stage: "all" | "last" | "none" (logits rows returned)


@dataclass
class StepResult:
    session_id: str
    epoch: int
    boundary: np.ndarray | None = None       # non-last stages: float32 [n, n_streams, n_embd]
    logits: np.ndarray | None = None         # last stage: float32 [rows, n_vocab]
    next_token: int | None = None            # last stage: greedy argmax of the last position's logits
    n_cached: int = 0                        # positions the session holds after this step


@dataclass(frozen=True)
class MemoryReport:
    weights_bytes: int
    kv_bytes: int                            # KV and other per-layer state actually allocated
    compute_bytes: int
    layers_with_state: tuple[int, ...] = field(default_factory=tuple)
    device_weights_bytes: int = 0            # of weights_bytes, those on the lane's device (not host memory)
    device: str = ""                         # that device's buffer type, e.g. "Vulkan0"; "" on the CPU lane


class ShardEngine(Protocol):
    """What a worker needs from an engine. Errors are dgr.core.errors types (CacheMiss, SchemaMismatch,
    EngineError); an engine never crashes the process on bad input."""

    def describe(self) -> StageInfo: ...

    def open_session(self, session_id: str, epoch: int) -> None: ...

    def close_session(self, session_id: str, epoch: int) -> None: ...

    def n_cached(self, session_id: str, epoch: int) -> int: ...

    def truncate(self, session_id: str, epoch: int, n_keep: int) -> None:
        """Drop the session's cached positions >= n_keep (0 <= n_keep <= n_cached): speculative positions
        the last stage rejected. EngineError where `describe().can_truncate` is False."""
        ...

    def forward(self, steps: list[Step]) -> list[StepResult]:
        """Run the steps of one or more sessions in one batch (where the engine allows)."""
        ...

    def tokenize(self, text: str, add_special: bool = True) -> list[int]: ...

    def detokenize(self, ids: list[int]) -> str: ...

    def vocab(self) -> VocabInfo:
        """The special tokens: bos, eos, eot and every id that ends a generation (a worker advertises
        `stop_ids` in Describe's eos_token_ids)."""
        ...

    def memory(self) -> MemoryReport: ...

    def close(self) -> None: ...
