"""The state every part of a stage worker shares: what the stage is, its open sessions, and the typed errors.

`StageState` is the base of the worker's parts (servicer, scheduler, links, origin; dgr.wire.worker
composes them): it holds the engine, the stage's identity and contract, the session table and the one
lock that guards it. The records below (`Session`, `Work`) are what those parts pass each other.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from dgr.engine_api import ShardEngine
from dgr.wire import codec
from dgr.wire.codec import hop_name
from dgr.wire.gen import stage_pb2 as pb

# Ends a frame queue: the request iterator of an outgoing stream, or the reply stream of an incoming one.
END = object()
# Put on an incoming stream's reply queue when the worker drains: the stream ends UNAVAILABLE.
DRAIN = object()
# The sender of a frame that never crossed the network (a one-stage route's token back into itself).
LOCAL = object()


@dataclass(frozen=True)
class Limits:
    """What a worker bounds, and how long it waits (`dgr worker serve` flags; docs/wire.md)."""

    max_batch_tokens: int = 512
    max_queued_steps: int = 512          # per worker: steps queued for the engine before OVERLOADED
    max_session_steps: int = 128         # per session (128 chunks of 64 tokens: an 8192-token prompt)
    session_ttl_s: float = 300.0         # idle sessions are reaped after this long (0: never)
    rpc_timeout_s: float = 5.0           # deadline per hop of the RPCs a worker makes (open/close chains)
    drain_timeout_s: float = 5.0         # SIGTERM: everything is stopped within this bound


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
    chat_template: str = ""                # the model's own (tokenizer.chat_template), for gateways


class WireFault(Exception):
    """A frame the worker refuses: becomes a dgr.v1.WireError answered to the sender."""

    def __init__(self, code: int, message: str, held: int = 0, expected: int = 0, retry_after_ms: int = 0):
        super().__init__(message)
        self.code, self.message, self.held, self.expected = code, message, held, expected
        self.retry_after_ms = retry_after_ms


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
    # bounded resources: when it last did anything (a session opened and never used is idle from the
    # start), and the positions its cache holds (the engine's n_cached after its last step)
    last_used: float = field(default_factory=time.monotonic)
    held: int = 0
    # mTLS: who opened it at this stage (the previous hop, or the client at stage 0); at the origin,
    # who may send its tokens back (the last hop) and its errors (any hop of the route)
    opener: str | None = None
    returner: str | None = None
    route_members: frozenset = frozenset()


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

    def __init__(self, engine: ShardEngine, identity: StageIdentity, *, address: str, max_message_bytes: int,
                 limits: Limits | None = None, tls=None):
        self.engine, self.identity = engine, identity
        self.limits = limits or Limits()
        self.tls = tls                                  # dgr.wire.tls.TlsConfig, or None: plaintext
        self.member = member_name(tls)
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
        self.reaped_sessions = 0
        self.overloaded = 0
        self.streams: set[queue.Queue] = set()          # reply queues of the incoming Frames streams

    @property
    def mutual_tls(self) -> bool:
        return self.tls is not None and self.tls.mutual

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


def member_name(tls) -> str:
    """The common name of this worker's own certificate ("" without TLS): what its peers see of it."""
    if tls is None:
        return ""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    try:
        cert = x509.load_pem_x509_certificate(tls.cert.read_bytes())
    except (OSError, ValueError):
        return ""
    return ",".join(sorted(a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)))


__all__ = ["DRAIN", "END", "LOCAL", "Limits", "Session", "StageIdentity", "StageState",
           "WireFault", "Work", "member_name"]
