"""The state every part of a stage worker shares: what the stage is, its open sessions, and the typed errors.

`StageState` is the base of the worker's parts (servicer, scheduler, links, origin; dgr.wire.worker
composes them): it holds the engine, the stage's identity and contract, the session table and the one
lock that guards it. The records below (`Session`, `Work`) are what those parts pass each other.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

import numpy as np

from dgr.engine_api import ShardEngine
from dgr.wire import codec
from dgr.wire.codec import hop_name
from dgr.wire.gen import stage_pb2 as pb

# Ends a frame queue: the request iterator of an outgoing stream, or the reply stream of an incoming one.
END = object()


@dataclass(frozen=True)
class StageIdentity:
    """What the engine's StageInfo does not know: where the stage comes from."""

    model: str
    bundle_id: str
    stage_index: int
    stage_count: int
    upstream_commit: str = ""
    patch_series: str = ""
    lane: str = "cpu"
    engine: str = "llama.cpp"
    wire_dtype: str = "f32"
    eos_token_ids: tuple[int, ...] = ()


class WireFault(Exception):
    """A frame the worker refuses: becomes a dgr.v1.WireError answered to the sender."""

    def __init__(self, code: int, message: str, held: int = 0, expected: int = 0):
        super().__init__(message)
        self.code, self.message, self.held, self.expected = code, message, held, expected


@dataclass
class Session:
    session_id: str
    epoch: int
    route: list
    hop_index: int
    sampling: pb.Sampling
    logits: int
    # origin (stage 0) only:
    client: queue.Queue | None = None  # reply stream of the client's Frames call
    max_new: int = 0
    stop_ids: frozenset = frozenset()
    produced: int = 0
    context_ids: list = field(default_factory=list)
    text: str = ""
    done: bool = False
    failed: bool = False


@dataclass
class Work:
    """One queued step: the frame, where errors about it go, and its decoded boundary."""

    frame: pb.Frame
    reply: queue.Queue | None          # where errors about this frame go
    t_recv: int
    x: np.ndarray | None = None
    transit_ns: int = 0


class StageState:
    """The engine, the stage, its sessions. `lock` guards the sessions and every part's shared tables
    (queued steps, links); `engine_lock` makes sure the engine is never called from two threads at once."""

    def __init__(self, engine: ShardEngine, identity: StageIdentity, *, address: str, max_message_bytes: int):
        self.engine, self.identity = engine, identity
        self.info = engine.describe()
        self.address = address
        self.max_message_bytes = max_message_bytes
        self.dtype = codec.dtype_code(identity.wire_dtype)
        self.contract = self.info.contract.with_dtype(identity.wire_dtype)   # the engine's, in the wire dtype
        # Token ids always travel with the boundary (a few bytes a token), so any later stage that owns
        # token-id layers (V4's hash layers) has them; token_ids=True says this sender provides them.
        out = self.contract.boundary_out
        self._boundary_in = self.contract.boundary_in
        self._boundary_out = None if out is None else out.model_copy(update={"token_ids": True})
        self.engine_lock = threading.Lock()
        self.lock = threading.RLock()                   # sessions, pending, links
        self.sessions: dict[tuple[str, int], Session] = {}
        self.latest_epoch: dict[str, int] = {}
        self.stopping = False

    @property
    def hop(self) -> str:
        return hop_name(self.identity.stage_index, self.address)

    def schema_in(self) -> pb.BoundarySchema | None:
        b = self._boundary_in
        return None if b is None else codec.schema_msg(b, self.identity.bundle_id, self.info.layer_begin)

    def schema_out(self) -> pb.BoundarySchema | None:
        b = self._boundary_out
        return None if b is None else codec.schema_msg(b, self.identity.bundle_id, self.info.layer_end)

    def _err(self, code: int, message: str, **kw) -> pb.WireError:
        return pb.WireError(code=code, message=f"{self.hop}: {message}", hop=self.hop, **kw)

    def _reply_error(self, reply: queue.Queue | None, frame: pb.Frame, err: pb.WireError) -> None:
        if reply is not None:
            reply.put(pb.Frame(session_id=frame.session_id, epoch=frame.epoch, error=err))
