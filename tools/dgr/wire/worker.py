"""The stage worker: one gRPC server per stage, over a ShardEngine (real or fake).

Threads: gRPC's pool runs the handlers; one reader thread per incoming frame stream turns frames into
queued steps; one engine thread takes queued steps of different sessions into one `engine.forward`
batch and hands each result on (next hop, or sampled token to the origin); one reader thread per
outgoing link watches the peer's replies (typed errors) and notices when the peer dies.

Ring: stage 0 is the route's origin. The client streams token ids into stage 0; each stage streams its
boundary straight to the next hop; the last stage samples and sends the token straight to stage 0, which
queues the next decode step itself and streams the token to the client. Errors about a frame go back one
hop on the reply stream of the stream it came on; a worker receiving an error from its next hop sends it
to the origin, which hands it to the client. docs/wire.md says why.
"""

from __future__ import annotations

import collections
import logging
import queue
import socket
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dgr.engine_api import ShardEngine, Step
from dgr.errors import CacheMiss, DgrError, SchemaMismatch, WireError
from dgr.wire import codec
from dgr.wire.codec import hop_name, schema_diff, schema_str
from dgr.wire.gen import stage_pb2 as pb
from dgr.wire.gen import stage_pb2_grpc as pb_grpc
from dgr.wire.sampling import sample

log = logging.getLogger("dgr.worker")
SERVICE_NAME = "dgr.v1.Stage"
_END = object()


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


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    # gRPC itself enforces the limit on both ends, so an oversized frame can never pass silently.
    limit = max_message_bytes + codec.FRAME_OVERHEAD
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]


class _WireFault(Exception):
    """A frame the worker refuses: becomes a dgr.v1.WireError answered to the sender."""

    def __init__(self, code: int, message: str, held: int = 0, expected: int = 0):
        super().__init__(message)
        self.code, self.message, self.held, self.expected = code, message, held, expected


@dataclass
class _Session:
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
class _Work:
    frame: pb.Frame
    reply: queue.Queue | None          # where errors about this frame go
    t_recv: int
    x: np.ndarray | None = None
    transit_ns: int = 0


class _Link:
    """An outgoing Frames stream to one peer, shared by all sessions going there."""

    def __init__(self, worker: StageWorker, address: str, label: str):
        self.worker, self.address, self.label = worker, address, label
        self.channel = grpc.insecure_channel(address, options=channel_options(worker.max_message_bytes))
        self.stub = pb_grpc.StageStub(self.channel)
        self.lock = threading.Lock()
        self.q: queue.Queue | None = None
        self.sessions: set = set()

    def send(self, frame: pb.Frame) -> None:
        with self.lock:
            if self.q is None:
                self.q = queue.Queue()
                self.sessions = set()
                call = self.stub.Frames(iter(self.q.get, _END))
                threading.Thread(target=self._read, args=(call, self.q), daemon=True,
                                 name=f"link-{self.address}").start()
            self.sessions.add((frame.session_id, frame.epoch))
            self.q.put(frame)

    def _read(self, call, q) -> None:
        try:
            for reply in call:
                self.worker._on_link_reply(self, reply)
        except grpc.RpcError as err:
            with self.lock:
                lost, self.sessions = self.sessions, set()
                if self.q is q:
                    self.q = None
            q.put(_END)                                 # release gRPC's request-consuming thread
            if err.code() != grpc.StatusCode.CANCELLED or not self.worker.stopping:
                self.worker._on_link_broken(self, err, lost)

    def close(self) -> None:
        with self.lock:
            if self.q is not None:
                self.q.put(_END)
                self.q = None
        self.channel.close()


class StageWorker(pb_grpc.StageServicer):
    def __init__(self, engine: ShardEngine, identity: StageIdentity, *, address: str = "",
                 max_message_bytes: int = codec.DEFAULT_MAX_MESSAGE_BYTES,
                 max_batch_tokens: int = 512, max_queued_steps: int = 4096):
        self.engine, self.identity = engine, identity
        self.info = engine.describe()
        self.address = address
        self.max_message_bytes = max_message_bytes
        self.max_batch_tokens = max_batch_tokens
        self.max_queued_steps = max_queued_steps
        self.dtype = codec.dtype_code(identity.wire_dtype)
        self.engine_lock = threading.Lock()
        self.lock = threading.RLock()                   # sessions, pending, links
        self.sessions: dict[tuple[str, int], _Session] = {}
        self.latest_epoch: dict[str, int] = {}
        self.pending: dict[tuple[str, int], collections.deque] = {}
        self.n_pending = 0
        self.jobs: collections.deque = collections.deque()   # engine-thread work that may wait a forward
        self.wake = threading.Condition(self.lock)
        self.links: dict[str, _Link] = {}
        self.max_frame_bytes_sent = 0
        self.stopping = False
        self.engine_thread = threading.Thread(target=self._engine_loop, daemon=True, name="engine")
        self.engine_thread.start()

    # ------------------------------------------------------------------ description
    @property
    def hop(self) -> str:
        return hop_name(self.identity.stage_index, self.address)

    def schema_in(self) -> pb.BoundarySchema | None:
        if self.info.is_first:
            return None
        return pb.BoundarySchema(n_streams=self.info.n_streams, n_embd=self.info.n_embd, dtype=self.dtype,
                                 token_ids=self.info.needs_token_ids, bundle_id=self.identity.bundle_id,
                                 layer=self.info.layer_begin)

    def schema_out(self) -> pb.BoundarySchema | None:
        if self.info.is_last:
            return None
        # Token ids always travel with the boundary (a few bytes a token), so any later stage that owns
        # token-id layers (V4's hash layers) has them; token_ids=True says this sender provides them.
        return pb.BoundarySchema(n_streams=self.info.n_streams, n_embd=self.info.n_embd, dtype=self.dtype,
                                 token_ids=True, bundle_id=self.identity.bundle_id,
                                 layer=self.info.layer_end)

    def describe_msg(self) -> pb.StageDescription:
        i, idn = self.info, self.identity
        d = pb.StageDescription(
            identity=pb.Identity(model=idn.model, bundle_id=idn.bundle_id, stage_index=idn.stage_index,
                                 stage_count=idn.stage_count, layer_begin=i.layer_begin,
                                 layer_end=i.layer_end, n_layer=i.n_layer,
                                 upstream_commit=idn.upstream_commit, patch_series=idn.patch_series,
                                 lane=idn.lane, arch=i.arch),
            is_first=i.is_first, is_last=i.is_last, has_vocab=i.has_vocab, n_vocab=i.n_vocab,
            n_ctx=i.n_ctx, max_sessions=i.max_sessions, open_sessions=len(self.sessions),
            queued_steps=self.n_pending, max_message_bytes=self.max_message_bytes,
            max_frame_bytes_sent=self.max_frame_bytes_sent, engine=idn.engine,
            eos_token_ids=list(idn.eos_token_ids))
        if (s := self.schema_in()) is not None:
            d.schema_in.CopyFrom(s)
        if (s := self.schema_out()) is not None:
            d.schema_out.CopyFrom(s)
            d.seam_bytes_per_token = codec.seam_bytes_per_token(s)
        return d

    # ------------------------------------------------------------------ unary RPCs
    def Describe(self, request, context):
        return self.describe_msg()

    def Tokenize(self, request, context):
        if not self.info.has_vocab:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self.hop} holds no vocabulary")
        with self.engine_lock:
            ids = self.engine.tokenize(request.text, request.add_special)
        return pb.TokenizeReply(token_ids=ids)

    def Detokenize(self, request, context):
        if not self.info.has_vocab:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self.hop} holds no vocabulary")
        with self.engine_lock:
            text = self.engine.detokenize(list(request.token_ids))
        return pb.DetokenizeReply(text=text)

    def _err(self, code: int, message: str, **kw) -> pb.WireError:
        return pb.WireError(code=code, message=f"{self.hop}: {message}", hop=self.hop, **kw)

    def OpenSession(self, req, context):
        me = self.describe_msg()
        ident = me.identity
        if req.hop_index >= len(req.route):
            return pb.OpenSessionReply(error=self._err(pb.BAD_FRAME, "hop_index is outside the route"))
        hop = req.route[req.hop_index]
        mine = f"stage {ident.stage_index} [{ident.layer_begin}, {ident.layer_end}) of bundle {ident.bundle_id}"
        want = f"stage {hop.stage_index} [{hop.layer_begin}, {hop.layer_end}) of bundle {hop.bundle_id}"
        if (hop.bundle_id, hop.stage_index) != (ident.bundle_id, ident.stage_index):
            return pb.OpenSessionReply(error=self._err(
                pb.WRONG_STAGE, f"the route expects {want} at {hop.address} but this worker serves {mine}: "
                                "fix the route or start the right worker"))
        if (hop.layer_begin, hop.layer_end) != (ident.layer_begin, ident.layer_end):
            return pb.OpenSessionReply(error=self._err(
                pb.WRONG_RANGE, f"the route expects {want} but this worker serves {mine}"))
        if (req.hop_index == 0) != self.info.is_first or \
                (req.hop_index == len(req.route) - 1) != self.info.is_last:
            return pb.OpenSessionReply(error=self._err(
                pb.WRONG_STAGE, f"this worker serves {mine} (first={self.info.is_first}, "
                                f"last={self.info.is_last}) but is hop {req.hop_index} of a "
                                f"{len(req.route)}-hop route: the route must cover every layer in order"))
        if req.hop_index > 0:
            up = req.upstream
            if not up.HasField("schema_out"):
                return pb.OpenSessionReply(error=self._err(
                    pb.WRONG_STAGE, "the previous hop did not say what it sends (no schema_out)"))
            theirs = f"{hop_name(up.identity.stage_index, req.route[req.hop_index - 1].address)}"
            diff = schema_diff(up.schema_out, me.schema_in)
            if me.schema_in.token_ids and not up.schema_out.token_ids:
                diff.append("token_ids")
            if diff:
                return pb.OpenSessionReply(error=self._err(
                    pb.SCHEMA_MISMATCH, f"{theirs} sends {schema_str(up.schema_out)} but this stage takes "
                                        f"{schema_str(me.schema_in)} (differs in {', '.join(diff)}): "
                                        "both hops must serve stages of the same bundle"))
            if up.schema_out.layer != me.schema_in.layer:
                return pb.OpenSessionReply(error=self._err(
                    pb.WRONG_RANGE, f"{theirs} hands over at layer {up.schema_out.layer} but this stage "
                                    f"begins at layer {me.schema_in.layer}"))
        if self.info.is_last:
            vocab_bytes = self.info.n_vocab * 4 + codec.FRAME_OVERHEAD
            if req.logits != pb.LOGITS_NONE and vocab_bytes > self.max_message_bytes:
                return pb.OpenSessionReply(error=self._err(
                    pb.MESSAGE_TOO_LARGE, f"one logits row needs {vocab_bytes} bytes, over the "
                                          f"{self.max_message_bytes}-byte message limit"))
        key = (req.session_id, req.epoch)
        with self.lock:
            if req.epoch < self.latest_epoch.get(req.session_id, 0) or key in self.sessions:
                return pb.OpenSessionReply(error=self._err(
                    pb.STALE_EPOCH, f"session {req.session_id} is already at epoch "
                                    f"{self.latest_epoch[req.session_id]}; open a newer epoch"))
            old = [k for k in self.sessions if k[0] == req.session_id]
            live = len(self.sessions) - len(old)
            if live >= self.info.max_sessions:
                return pb.OpenSessionReply(error=self._err(
                    pb.OVERLOADED, f"all {self.info.max_sessions} sessions are in use: retry later or "
                                   "use another route"))
        for k in old:
            self._close_local(*k)
        try:
            with self.engine_lock:
                self.engine.open_session(req.session_id, req.epoch)
        except DgrError as err:
            return pb.OpenSessionReply(error=self._err(pb.ENGINE, str(err)))
        sess = _Session(req.session_id, req.epoch, list(req.route), req.hop_index, req.sampling, req.logits)
        with self.lock:
            self.sessions[key] = sess
            self.latest_epoch[req.session_id] = req.epoch
        hops = [me]
        if not self.info.is_last:
            nxt = req.route[req.hop_index + 1]
            fwd = pb.OpenSessionRequest()
            fwd.CopyFrom(req)
            fwd.hop_index = req.hop_index + 1
            fwd.upstream.CopyFrom(me)
            try:
                reply = self._link(nxt.address, req.hop_index + 1).stub.OpenSession(fwd, timeout=60)
            except grpc.RpcError as err:
                name = hop_name(req.hop_index + 1, nxt.address)
                reply = pb.OpenSessionReply(error=pb.WireError(code=pb.HOP_UNREACHABLE, hop=name, message=(
                    f"{name} is unreachable: {self.hop} could not open the session there ({err.code().name}: "
                    f"{err.details()}): is that worker running?")))
            if reply.HasField("error"):
                self._close_local(*key)
                return reply
            hops.extend(reply.hops)
        return pb.OpenSessionReply(hops=hops)

    def CloseSession(self, req, context):
        sess = self.sessions.get((req.session_id, req.epoch))
        self._close_local(req.session_id, req.epoch)
        if req.chain and sess is not None and not self.info.is_last:
            nxt = sess.route[sess.hop_index + 1]
            try:
                self._link(nxt.address, sess.hop_index + 1).stub.CloseSession(req, timeout=10)
            except grpc.RpcError as err:
                return pb.CloseSessionReply(error=self._err(
                    pb.HOP_UNREACHABLE, f"could not close on {hop_name(sess.hop_index + 1, nxt.address)}: "
                                        f"{err.code().name}"))
        return pb.CloseSessionReply()

    def _close_local(self, session_id: str, epoch: int) -> None:
        with self.lock:
            self.sessions.pop((session_id, epoch), None)
            dropped = self.pending.pop((session_id, epoch), None)
            self.n_pending -= len(dropped or ())
        with self.engine_lock:
            self.engine.close_session(session_id, epoch)

    # ------------------------------------------------------------------ the data plane
    def Frames(self, request_iterator, context):
        out: queue.Queue = queue.Queue()

        def read():
            try:
                for frame in request_iterator:
                    self._on_frame(frame, out)
            except grpc.RpcError:
                pass                                   # the caller went away
            except Exception:                          # never let one stream take the worker down
                log.exception("frame stream failed")
            finally:
                out.put(_END)

        threading.Thread(target=read, daemon=True, name="frames-in").start()
        context.add_callback(lambda: (out.put(_END), self._client_gone(out)))
        while True:
            item = out.get()
            if item is _END:
                return
            yield item

    def _client_gone(self, out: queue.Queue) -> None:
        """The client's stream ended: stop decoding for it and free its sessions along the route."""
        with self.lock:
            orphans = [k for k, v in self.sessions.items() if v.client is out and not v.done]
            for k in orphans:
                self.sessions[k].failed = True
        for sid, epoch in orphans:
            threading.Thread(target=self.CloseSession, args=(
                pb.CloseSessionRequest(session_id=sid, epoch=epoch, chain=True), None), daemon=True).start()

    def _reply_error(self, reply: queue.Queue | None, frame: pb.Frame, err: pb.WireError) -> None:
        if reply is not None:
            reply.put(pb.Frame(session_id=frame.session_id, epoch=frame.epoch, error=err))

    def _on_frame(self, frame: pb.Frame, reply: queue.Queue) -> None:
        kind = frame.WhichOneof("body")
        transit = max(0, time.time_ns() - frame.sent_unix_ns) if frame.sent_unix_ns else 0
        if kind == "token":
            frame.token.return_ns = transit
        if kind in ("token", "logits", "error"):
            self._deliver_to_client(frame)             # returns into the origin
            return
        key = (frame.session_id, frame.epoch)
        with self.lock:
            sess = self.sessions.get(key)
        try:
            if sess is None:
                latest = self.latest_epoch.get(frame.session_id)
                if latest is not None and latest > frame.epoch:
                    raise _WireFault(pb.STALE_EPOCH, f"session {frame.session_id} epoch {frame.epoch} was "
                                                     f"replaced by epoch {latest}")
                raise _WireFault(pb.UNKNOWN_SESSION, f"no open session {frame.session_id} epoch "
                                                     f"{frame.epoch}: open it (OpenSession) first")
            if kind == "generate":
                if not self.info.is_first:
                    raise _WireFault(pb.BAD_FRAME, "generate frames go to stage 0 only")
                with self.lock:
                    sess.client = reply
                    sess.max_new = frame.generate.max_new_tokens
                    sess.stop_ids = frozenset(frame.generate.stop_token_ids)
                    sess.context_ids = list(frame.generate.context_ids)
                    sess.text = frame.generate.context_text
                return
            if kind != "step":
                raise _WireFault(pb.BAD_FRAME, f"unexpected frame body {kind!r}")
            x = self._check_step(frame.step, sess)
        except _WireFault as f:
            self._reply_error(reply, frame, self._err(f.code, f.message, held=f.held, expected=f.expected))
            return
        if self.info.is_first:
            with self.lock:
                if sess.client is None:
                    sess.client = reply
            frame.origin_sent_ns = time.monotonic_ns()
        self._enqueue(_Work(frame, reply, time.monotonic_ns(), x, transit), sess)

    def _enqueue(self, work: _Work, sess: _Session) -> None:
        key = (work.frame.session_id, work.frame.epoch)
        with self.lock:
            if self.n_pending >= self.max_queued_steps:
                self._reply_error(work.reply, work.frame, self._err(
                    pb.OVERLOADED, f"{self.n_pending} steps are queued: retry later"))
                return
            self.pending.setdefault(key, collections.deque()).append(work)
            self.n_pending += 1
            self.wake.notify()

    def _check_step(self, step: pb.Step, sess: _Session) -> np.ndarray | None:
        """Refuse malformed frames before they reach the engine queue; returns the decoded boundary."""
        info = self.info
        n = len(step.positions)
        if n == 0:
            raise _WireFault(pb.BAD_FRAME, "a step needs at least one position")
        p0 = step.positions[0]
        if list(step.positions) != list(range(p0, p0 + n)):
            raise _WireFault(pb.BAD_FRAME, "positions must be contiguous and increasing")
        if step.cache_expect != p0:
            raise _WireFault(pb.BAD_FRAME, f"cache_expect {step.cache_expect} != first position {p0}")
        if p0 + n > info.n_ctx:
            raise _WireFault(pb.ENGINE, f"positions up to {p0 + n - 1} exceed the context of {info.n_ctx}")
        if info.is_first:
            if len(step.token_ids) != n:
                raise _WireFault(pb.BAD_FRAME, f"stage 0 needs one token id per position ({n}), got "
                                               f"{len(step.token_ids)}")
            if step.HasField("boundary"):
                raise _WireFault(pb.SCHEMA_MISMATCH, "stage 0 takes token ids, not a boundary")
            return None
        want = self.schema_in()
        if not step.HasField("schema"):
            raise _WireFault(pb.SCHEMA_MISMATCH, f"the frame names no schema; this stage takes {schema_str(want)}")
        diff = schema_diff(step.schema, want)
        if diff:
            raise _WireFault(pb.SCHEMA_MISMATCH, f"frame schema {schema_str(step.schema)} differs from this "
                                                 f"stage's {schema_str(want)} in {', '.join(diff)}")
        if step.schema.layer != want.layer:
            raise _WireFault(pb.WRONG_RANGE, f"the boundary is for layer {step.schema.layer} but this stage "
                                             f"owns [{info.layer_begin}, {info.layer_end})")
        if info.needs_token_ids and len(step.token_ids) != n:
            raise _WireFault(pb.SCHEMA_MISMATCH, f"this stage owns token-id layers and needs the token-id "
                                                 f"sideband ({n} ids), got {len(step.token_ids)}")
        b = step.boundary
        shape = [n, info.n_streams, info.n_embd]
        if list(b.shape) != shape:
            raise _WireFault(pb.BAD_FRAME, f"boundary shape {list(b.shape)} != {shape} "
                                           "[n_tokens, n_streams, n_embd]")
        if b.dtype != want.dtype:
            raise _WireFault(pb.SCHEMA_MISMATCH, f"boundary dtype {codec.DTYPE_NAMES.get(b.dtype, b.dtype)} "
                                                 f"!= schema dtype {codec.DTYPE_NAMES[want.dtype]}")
        try:
            return codec.decode(b)
        except ValueError as err:
            raise _WireFault(pb.BAD_FRAME, str(err)) from None

    # ------------------------------------------------------------------ the engine loop
    def _take_batch(self) -> list[_Work]:
        with self.lock:
            while not self.stopping and not self.n_pending and not self.jobs:
                self.wake.wait(0.5)
            batch, tokens = [], 0
            for key in list(self.pending):
                dq = self.pending[key]
                n = len(dq[0].frame.step.positions)
                if batch and tokens + n > self.max_batch_tokens:
                    continue
                batch.append(dq.popleft())
                tokens += n
                self.n_pending -= 1
                if not dq:
                    del self.pending[key]
                elif len(self.pending) > 1:             # round robin: served sessions go to the back
                    self.pending[key] = self.pending.pop(key)
            return batch

    def _engine_loop(self) -> None:
        while not self.stopping:
            batch = self._take_batch()
            if batch:
                try:
                    self._run_batch(batch)
                except Exception:
                    log.exception("engine batch failed")
                    for w in batch:
                        self._reply_error(w.reply, w.frame, self._err(pb.INTERNAL, "the worker failed on "
                                                                      "this step; see its log"))
            self._run_jobs()

    def _defer(self, job) -> None:
        """Run `job` on the engine thread after the current forward (never ahead of queued steps' start)."""
        with self.lock:
            self.jobs.append(job)
            self.wake.notify()

    def _run_jobs(self) -> None:
        while True:
            with self.lock:
                if not self.jobs:
                    return
                job = self.jobs.popleft()
            try:
                job()
            except Exception:
                log.exception("deferred job failed")

    def _to_step(self, w: _Work, sess: _Session) -> Step:
        s = w.frame.step
        want = "none"
        if self.info.is_last and (s.sample or sess.logits == pb.LOGITS_ALL):
            want = "all" if sess.logits == pb.LOGITS_ALL else "last"
        ids = np.asarray(s.token_ids, dtype=np.int32) if len(s.token_ids) else None
        return Step(w.frame.session_id, w.frame.epoch, np.asarray(s.positions, dtype=np.int32),
                    token_ids=ids, boundary=w.x, want_logits=want)

    def _run_batch(self, batch: list[_Work]) -> None:
        ready, steps = [], []
        with self.engine_lock:
            for w in batch:
                key = (w.frame.session_id, w.frame.epoch)
                sess = self.sessions.get(key)
                if sess is None:
                    continue                            # closed while queued
                try:
                    held = self.engine.n_cached(*key)
                except DgrError as err:
                    self._reply_error(w.reply, w.frame, self._err(pb.ENGINE, str(err)))
                    continue
                if held != w.frame.step.cache_expect:
                    self._reply_error(w.reply, w.frame, self._err(
                        pb.CACHE_MISS, f"session {key[0]} epoch {key[1]} holds {held} positions here but "
                                       f"the frame expects {w.frame.step.cache_expect}: re-prefill at a new "
                                       "epoch", held=held, expected=w.frame.step.cache_expect))
                    continue
                ready.append((w, sess))
                steps.append(self._to_step(w, sess))
            if not steps:
                return
            t0 = time.monotonic_ns()
            results = self._forward(steps, ready)
            compute = time.monotonic_ns() - t0
        for (w, sess), res in zip(ready, results):
            if res is None:
                continue
            timing = pb.HopTiming(stage_index=self.identity.stage_index, queue_ns=t0 - w.t_recv,
                                  transit_ns=w.transit_ns,
                                  compute_ns=compute)
            if self.info.is_last:
                self._emit_last(w, sess, res, timing)
            else:
                self._emit_boundary(w, sess, res, timing)

    def _forward(self, steps, ready):
        """One batched forward; if it fails, find the step at fault so other sessions keep going."""
        try:
            return self.engine.forward(steps)
        except DgrError as err:
            if len(steps) == 1:
                self._fail_step(ready[0][0], err)
                return [None]
            before = [self.engine.n_cached(s.session_id, s.epoch) for s in steps]
            log.info("batch of %d failed (%s); running its steps one by one", len(steps), err)
        results = []
        for step, (w, _), held in zip(steps, ready, before):
            if self.engine.n_cached(step.session_id, step.epoch) != held:
                self._fail_step(w, DgrError("the engine failed inside a shared batch"))
                results.append(None)
                continue
            try:
                results.append(self.engine.forward([step])[0])
            except DgrError as err:
                self._fail_step(w, err)
                results.append(None)
        return results

    def _fail_step(self, w: _Work, err: DgrError) -> None:
        if isinstance(err, CacheMiss):
            e = self._err(pb.CACHE_MISS, str(err), held=err.held, expected=err.expected)
        elif isinstance(err, SchemaMismatch):
            e = self._err(pb.SCHEMA_MISMATCH, str(err))
        else:
            e = self._err(pb.ENGINE, str(err))
        self._reply_error(w.reply, w.frame, e)

    def _send(self, address: str, hop_index: int, frame: pb.Frame, sess: _Session) -> None:
        frame.sent_unix_ns = time.time_ns()
        size = frame.ByteSize()
        if size > self.max_message_bytes:               # a bug if it happens: frames are sized below
            self._to_origin(sess, pb.Frame(session_id=sess.session_id, epoch=sess.epoch, error=self._err(
                pb.MESSAGE_TOO_LARGE, f"a {size}-byte frame would exceed the {self.max_message_bytes}-byte "
                                      "limit")))
            return
        self.max_frame_bytes_sent = max(self.max_frame_bytes_sent, size)
        if address == self.address and hop_index == 0 and self.info.is_first:
            self._on_frame(frame, None)                 # a one-stage route: the origin is this worker
            return
        self._link(address, hop_index).send(frame)

    def _emit_boundary(self, w: _Work, sess: _Session, res, timing: pb.HopTiming) -> None:
        t0 = time.monotonic_ns()
        s = w.frame.step
        nxt = sess.route[sess.hop_index + 1]
        schema = self.schema_out()
        per = codec.tokens_per_frame(self.max_message_bytes, codec.seam_bytes_per_token(schema))
        n = len(s.positions)
        frames = []
        for lo in range(0, n, per):
            hi = min(n, lo + per)
            step = pb.Step(positions=s.positions[lo:hi], token_ids=s.token_ids[lo:hi],
                           boundary=codec.encode(res.boundary[lo:hi], self.dtype), schema=schema,
                           cache_expect=s.positions[lo], sample=s.sample and hi == n)
            frames.append(pb.Frame(session_id=sess.session_id, epoch=sess.epoch, step=step,
                                   origin_sent_ns=w.frame.origin_sent_ns, timings=w.frame.timings))
        timing.wire_ns = time.monotonic_ns() - t0
        for f in frames:
            f.timings.append(timing)
            self._send(nxt.address, sess.hop_index + 1, f, sess)

    def _emit_last(self, w: _Work, sess: _Session, res, timing: pb.HopTiming) -> None:
        t0 = time.monotonic_ns()
        s = w.frame.step
        origin = sess.route[0].address
        frames = []
        if sess.logits == pb.LOGITS_ALL and res.logits is not None and len(res.logits):
            rows_per = max(1, (self.max_message_bytes - codec.FRAME_OVERHEAD) // (self.info.n_vocab * 4 + 8))
            for lo in range(0, len(res.logits), rows_per):
                rows = res.logits[lo:lo + rows_per]
                frames.append(pb.Frame(session_id=sess.session_id, epoch=sess.epoch, logits=pb.Logits(
                    positions=s.positions[lo:lo + len(rows)], values=rows.astype("<f4").tobytes())))
        if s.sample:
            row = res.logits[-1]
            sp = sess.sampling
            pos = s.positions[-1]
            tok = sample(row, temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, seed=sp.seed,
                         position=pos)
            token = pb.Token(token_id=tok, position=pos, origin_sent_ns=w.frame.origin_sent_ns)
            if sess.logits == pb.LOGITS_LAST:
                token.logits = row.astype("<f4").tobytes()
            frames.append(pb.Frame(session_id=sess.session_id, epoch=sess.epoch, token=token,
                                   origin_sent_ns=w.frame.origin_sent_ns, timings=w.frame.timings))
        timing.wire_ns = time.monotonic_ns() - t0
        for f in frames:
            if f.HasField("token"):
                f.timings.append(timing)
                f.token.timings.extend(f.timings)
            self._send(origin, 0, f, sess)

    # ------------------------------------------------------------------ links and the origin
    def _link(self, address: str, hop_index: int) -> _Link:
        with self.lock:
            link = self.links.get(address)
            if link is None:
                link = self.links[address] = _Link(self, address, hop_name(hop_index, address))
            return link

    def _to_origin(self, sess: _Session, frame: pb.Frame) -> None:
        if self.info.is_first:
            self._deliver_to_client(frame)
        else:
            self._send(sess.route[0].address, 0, frame, sess)

    def _on_link_reply(self, link: _Link, frame: pb.Frame) -> None:
        """A peer answered an error about a frame this worker sent: hand it to the origin."""
        with self.lock:
            sess = self.sessions.get((frame.session_id, frame.epoch))
        if sess is not None:
            self._to_origin(sess, frame)

    def _on_link_broken(self, link: _Link, err: grpc.RpcError, lost: set) -> None:
        with self.lock:
            sessions = [self.sessions[k] for k in lost if k in self.sessions]
        for sess in sessions:
            idx = next((i for i, h in enumerate(sess.route) if h.address == link.address), -1)
            name = hop_name(idx, link.address) if idx >= 0 else link.address
            e = pb.WireError(code=pb.HOP_UNREACHABLE, hop=name, message=(
                f"{name} is unreachable: {self.hop} lost its stream to it ({err.code().name}: "
                f"{err.details() or ''}); that worker may have died: restart it and retry (recovery comes later)"))
            frame = pb.Frame(session_id=sess.session_id, epoch=sess.epoch, error=e)
            if link.address == sess.route[0].address:
                log.warning("origin unreachable for session %s: %s", sess.session_id, e.message)
            else:
                self._to_origin(sess, frame)

    def _deliver_to_client(self, frame: pb.Frame) -> None:
        """Origin: a token, logits rows or an error came back around the ring."""
        key = (frame.session_id, frame.epoch)
        with self.lock:
            sess = self.sessions.get(key)
        if sess is None or sess.client is None or not self.info.is_first:
            return
        kind = frame.WhichOneof("body")
        if kind == "error":
            sess.failed = True
            sess.client.put(frame)
            return
        if kind == "logits":
            sess.client.put(frame)
            return
        tok = frame.token
        tok.ring_ns = time.monotonic_ns() - tok.origin_sent_ns if tok.origin_sent_ns else 0
        sess.produced += 1
        sess.context_ids.append(tok.token_id)
        tok.done = tok.token_id in sess.stop_ids or sess.produced >= sess.max_new
        pos = tok.position + 1
        if not tok.done and not sess.failed:
            # queue the next decode step first: the ring goes on while this token is detokenized and sent
            if pos >= self.info.n_ctx:
                sess.failed = True
                sess.client.put(pb.Frame(session_id=sess.session_id, epoch=sess.epoch, error=self._err(
                    pb.ENGINE, f"the context of {self.info.n_ctx} positions is full")))
            else:
                nxt = pb.Frame(session_id=sess.session_id, epoch=sess.epoch, origin_sent_ns=time.monotonic_ns(),
                               step=pb.Step(positions=[pos], token_ids=[tok.token_id], cache_expect=pos,
                                            sample=True))
                self._enqueue(_Work(nxt, sess.client, time.monotonic_ns()), sess)
        else:
            sess.done = True
        # Detokenize on the engine thread once the next step's forward has started: text never delays
        # the ring, and the engine is never called from two threads.
        self._defer(lambda n=len(sess.context_ids): self._send_token(sess, frame, n))

    def _send_token(self, sess: _Session, frame: pb.Frame, n_ids: int) -> None:
        tok = frame.token
        full = ""
        if self.info.has_vocab:
            with self.engine_lock:
                full = self.engine.detokenize(sess.context_ids[:n_ids])
        if full.endswith("\ufffd") and not tok.done:
            tok.text = ""                               # an unfinished UTF-8 sequence: wait for more
        else:
            tok.text, sess.text = full[len(sess.text):], full
        sess.client.put(frame)

    # ------------------------------------------------------------------ lifecycle
    def stop(self) -> None:
        self.stopping = True
        with self.lock:
            self.wake.notify_all()
            links = list(self.links.values())
        for link in links:
            link.close()


def serve(engine: ShardEngine, identity: StageIdentity, listen: str, *,
          max_message_bytes: int = codec.DEFAULT_MAX_MESSAGE_BYTES, max_batch_tokens: int = 512,
          threads: int | None = None) -> tuple[grpc.Server, StageWorker, str]:
    """Start serving; returns (server, worker, bound address). Port 0 picks a free port."""
    info = engine.describe()
    # no SO_REUSEPORT: a second worker on a taken port must fail, not silently share its connections
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads or info.max_sessions * 2 + 16),
                         options=[*channel_options(max_message_bytes), ("grpc.so_reuseport", 0)])
    host, _, port = listen.rpartition(":")
    try:
        bound = server.add_insecure_port(listen)
    except RuntimeError:
        bound = 0
    if not host or bound == 0:
        raise WireError(f"cannot listen on {listen!r}: give HOST:PORT with a free port (port 0 picks one)")
    # errors name this hop by its address; a wildcard listen address names no machine, the host name does
    address = f"{socket.gethostname() if host in ('0.0.0.0', '[::]') else host}:{bound}"
    worker = StageWorker(engine, identity, address=address, max_message_bytes=max_message_bytes,
                         max_batch_tokens=max_batch_tokens)
    pb_grpc.add_StageServicer_to_server(worker, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, worker, address
