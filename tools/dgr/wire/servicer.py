"""The gRPC Stage servicer: Describe, Tokenize, OpenSession/CloseSession, and incoming frame streams.

`StageWorker` is the whole worker: this servicer composed with the scheduler (dgr.wire.scheduler), the
outgoing links (dgr.wire.links) and the origin's generation control (dgr.wire.origin), all over one
StageState (dgr.wire.state). Here a session is checked against the route and opened hop by hop, and
every incoming frame is checked before it is queued: a malformed one is answered with a typed
dgr.v1.WireError on the stream it came on, and the worker keeps serving.
"""

from __future__ import annotations

import queue
import threading
import time

import grpc
import numpy as np

from dgr.engine_api import ShardEngine
from dgr.errors import DgrError
from dgr.log import get_logger
from dgr.wire import codec
from dgr.wire.codec import hop_name, schema_diff, schema_str
from dgr.wire.drafts import DEFAULT_DRAFT_K, MAX_DRAFT_K, check_k, make_source
from dgr.wire.tls import peer_identity
from dgr.wire.gen import stage_pb2 as pb
from dgr.wire.gen import stage_pb2_grpc as pb_grpc
from dgr.wire.links import Links
from dgr.wire.origin import Origin, context_full
from dgr.wire.scheduler import Scheduler
from dgr.wire.state import DRAIN, END, LOCAL, Limits, Session, StageIdentity, StageState, WireFault, Work

log = get_logger(__name__)


class StageWorker(Scheduler, Links, Origin, pb_grpc.StageServicer):
    """One stage's worker: the Stage RPCs here, the parts' jobs in their modules, one StageState."""

    def __init__(self, engine: ShardEngine, identity: StageIdentity, *, address: str = "",
                 max_message_bytes: int = codec.DEFAULT_MAX_MESSAGE_BYTES, limits: Limits | None = None,
                 tls=None):
        StageState.__init__(self, engine, identity, address=address, max_message_bytes=max_message_bytes,
                            limits=limits, tls=tls)
        self._init_scheduler()
        self._init_links()
        self.server = self.health = None                # set by dgr.wire.worker.serve
        self._start_engine_thread()                     # last: the engine thread reads all of the above
        self.reaper = threading.Thread(target=self._reap_loop, daemon=True, name="reaper")
        self.reaper.start()

    # ------------------------------------------------------------------ description
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
            eos_token_ids=list(idn.eos_token_ids), chat_template=idn.chat_template, reaped_sessions=self.reaped_sessions,
            session_ttl_s=self.limits.session_ttl_s, max_queued_steps=self.limits.max_queued_steps,
            overloaded=self.overloaded, tls=self.tls is not None, mutual_tls=self.mutual_tls,
            cached_positions=sum(s.held for s in list(self.sessions.values())), member=self.member,
            can_roll_back=i.can_truncate, batch_invariant=i.batch_invariant, native_address=self.native.address if self.native else "")
        if self.native is not None:
            d.native_steps, d.native_forwards = self.native.counts()
        if (s := self.schema_in()) is not None:
            d.schema_in.CopyFrom(s)
        if (s := self.schema_out()) is not None:
            d.schema_out.CopyFrom(s)
            d.seam_bytes_per_token = codec.seam_bytes_per_token(s)
        return d

    # ------------------------------------------------------------------ unary RPCs
    def Describe(self, request, context):
        d = self.describe_msg()
        try:                                            # a liveness probe must never fail on the descriptor
            d.descriptor_json = self.descriptor().model_dump_json()
        except Exception:                               # noqa: BLE001
            log.exception("could not build the descriptor")
        return d

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

    def OpenSession(self, req, context):
        if self.stopping:
            return pb.OpenSessionReply(error=self._err(
                pb.HOP_UNREACHABLE, "this worker is shutting down: open the session on another replica"))
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
                self.overloaded += 1
                return pb.OpenSessionReply(error=self._err(
                    pb.OVERLOADED, f"all {self.info.max_sessions} sessions are in use: retry later or "
                                   "use another route", retry_after_ms=self._session_retry_ms()))
        for k in old:
            self._close_local(*k)
        try:
            with self.engine_lock:
                self.engine.open_session(req.session_id, req.epoch)
        except DgrError as err:
            return pb.OpenSessionReply(error=self._err(pb.ENGINE, str(err)))
        sess = Session(req.session_id, req.epoch, list(req.route), req.hop_index, req.sampling, req.logits,
                       opener=peer_identity(context) if context is not None else None)
        with self.lock:
            self.sessions[key] = sess
            self.opened_total += 1
            self.latest_epoch[req.session_id] = req.epoch
        hops = [me]
        if not self.info.is_last:
            nxt = req.route[req.hop_index + 1]
            fwd = pb.OpenSessionRequest()
            fwd.CopyFrom(req)
            fwd.hop_index = req.hop_index + 1
            fwd.upstream.CopyFrom(me)
            try:
                reply = self._link(nxt.address, req.hop_index + 1).stub.OpenSession(
                    fwd, timeout=self._chain_timeout(len(req.route) - 1 - req.hop_index, context))
            except grpc.RpcError as err:
                name = hop_name(req.hop_index + 1, nxt.address)
                self._count_error(pb.HOP_UNREACHABLE)
                reply = pb.OpenSessionReply(error=pb.WireError(code=pb.HOP_UNREACHABLE, hop=name, message=(
                    f"{name} is unreachable: {self.hop} could not open the session there ({err.code().name}: "
                    f"{err.details()}): is that worker running?")))
            if reply.HasField("error"):
                self._close_local(*key)
                return reply
            hops.extend(reply.hops)
        # speculation: every hop must roll back; a speculative step (k+1 positions) is never split
        no = [hop_name(h.identity.stage_index, r.address) for h, r in zip(hops, req.route[req.hop_index:])
              if not h.can_roll_back]
        sess.can_roll_back, sess.no_roll_back = not no, ", ".join(no)
        sess.spec_cap = min([codec.tokens_per_frame(min(h.max_message_bytes, self.max_message_bytes),
                                                    h.seam_bytes_per_token)
                             for h in hops if h.HasField("schema_out") and h.seam_bytes_per_token] or [MAX_DRAFT_K + 1])
        self._register_native(req, sess, hops)
        # the origin takes tokens back only from the last hop, errors from any hop of the route (mTLS)
        sess.returner = hops[-1].member or None
        sess.route_members = frozenset(h.member for h in hops if h.member)
        self.metrics.opened.inc()
        return pb.OpenSessionReply(hops=hops)

    def _register_native(self, req, sess: Session, hops: list) -> None:
        """A session this stage and every later hop can run on the native plane (any sampling, no logits or
        the sampled row, an f32 boundary: what the plane does) is registered there, with the next hop's plane (the last
        stage's tokens go to the origin each frame names). The origin hands its decode over after the
        prefill."""
        if self.native is None or req.logits == pb.LOGITS_ALL:
            return
        # native frames carry float32 boundaries: a route with a lossy wire dtype stays on gRPC, which
        # rounds the boundary to it at every seam as the route asked
        if not all(h.native_address and (not h.HasField("schema_out") or h.schema_out.dtype == pb.F32) for h in hops):
            return
        self.native.session(req.session_id, req.epoch, "" if self.info.is_last else hops[1].native_address,
                            logits=req.logits == pb.LOGITS_LAST, sampling=req.sampling)
        sess.native = True

    def _chain_timeout(self, hops_after: int, context) -> float:
        """The deadline of a chained RPC: one rpc_timeout per hop still to go (so the hop nearest a fault
        times out first and is the one named), never past the caller's own deadline."""
        t = self.limits.rpc_timeout_s * max(1, hops_after)
        left = context.time_remaining() if context is not None else None
        return max(0.1, min(t, left - 0.2)) if left is not None else t

    def _session_retry_ms(self) -> int:
        """When a session slot may free up: the next idle session's reaping, else a second."""
        ttl = self.limits.session_ttl_s
        if ttl <= 0 or not self.sessions:
            return 1000
        idle = max(time.monotonic() - s.last_used for s in list(self.sessions.values()))
        return int(min(ttl, max(0.1, ttl - idle)) * 1000)

    def CloseSession(self, req, context):
        sess = self.sessions.get((req.session_id, req.epoch))
        self._close_local(req.session_id, req.epoch)
        if req.chain and sess is not None and not self.info.is_last:
            nxt = sess.route[sess.hop_index + 1]
            try:
                self._link(nxt.address, sess.hop_index + 1).stub.CloseSession(
                    req, timeout=self._chain_timeout(len(sess.route) - 1 - sess.hop_index, context))
            except grpc.RpcError as err:
                return pb.CloseSessionReply(error=self._err(
                    pb.HOP_UNREACHABLE, f"could not close on {hop_name(sess.hop_index + 1, nxt.address)}: "
                                        f"{err.code().name}"))
            except ValueError:                          # this worker is stopping: its links are closed
                pass
        return pb.CloseSessionReply()

    def _close_local(self, session_id: str, epoch: int) -> None:
        if self.native is not None:
            self.native.forget(session_id, epoch)
        with self.lock:
            self.sessions.pop((session_id, epoch), None)
            self._drop_pending(session_id, epoch)
        with self.engine_lock:
            self.engine.close_session(session_id, epoch)

    # ------------------------------------------------------------------ the data plane
    def Frames(self, request_iterator, context):
        out: queue.Queue = queue.Queue()
        peer = peer_identity(context)
        if self.stopping:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.hop} is shutting down")
        with self.lock:
            self.streams.add(out)

        def read():
            try:
                for frame in request_iterator:
                    self._on_frame(frame, out, peer)
            except grpc.RpcError:
                pass                                   # the caller went away
            except Exception:                          # never let one stream take the worker down
                log.exception("frame stream failed")
            finally:
                out.put(END)

        threading.Thread(target=read, daemon=True, name="frames-in").start()
        context.add_callback(lambda: (out.put(END), self._client_gone(out)))
        try:
            while True:
                item = out.get()
                if item is END:
                    return
                if item is DRAIN:
                    context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.hop} is shutting down (SIGTERM): its "
                                                               "sessions are closed; use another replica")
                yield item
        finally:
            with self.lock:
                self.streams.discard(out)

    def _check_sender(self, kind: str, sess: Session | None, peer) -> None:
        """mTLS: a session's frames come only from the peer that opened it here; tokens back into the
        origin only from its last hop, errors from a hop of its route."""
        if not self.mutual_tls or peer is LOCAL or sess is None:
            return
        if kind in ("token", "logits"):
            want, what = ({sess.returner} if sess.returner else set()), "the route's last hop"
        elif kind == "error":
            want, what = set(sess.route_members), "a hop of the route"
        else:
            want = {sess.opener} if sess.opener else set()
            what = "the client" if self.info.is_first else f"stage {self.identity.stage_index - 1}"
            what = f"the peer that opened it at this stage ({what})"
        if want and peer not in want:
            raise WireFault(pb.WRONG_STAGE, f"{kind} frames of session {sess.session_id} are accepted here only "
                                            f"from {what}, member {' or '.join(sorted(want))}; this stream "
                                            f"comes from member {peer or '(no certificate name)'}")

    def _on_frame(self, frame: pb.Frame, reply: queue.Queue | None, peer=LOCAL) -> None:
        kind = frame.WhichOneof("body")
        transit = max(0, time.time_ns() - frame.sent_unix_ns) if frame.sent_unix_ns else 0
        key = (frame.session_id, frame.epoch)
        with self.lock:
            sess = self.sessions.get(key)
        if kind in ("token", "logits", "error"):
            try:
                self._check_sender(kind, sess, peer)
            except WireFault as f:
                log.warning("refused a frame: %s", f.message)
                if kind != "error":
                    self._reply_error(reply, frame, self._err(f.code, f.message))
                return
            if kind == "token":
                frame.token.return_ns = transit
                if transit:
                    self.metrics.transit["token"].observe(transit / 1e9)
            self._deliver_to_client(frame)             # returns into the origin
            return
        try:
            if sess is None:
                latest = self.latest_epoch.get(frame.session_id)
                if latest is not None and latest > frame.epoch:
                    raise WireFault(pb.STALE_EPOCH, f"session {frame.session_id} epoch {frame.epoch} was "
                                                    f"replaced by epoch {latest}")
                raise WireFault(pb.UNKNOWN_SESSION, f"no open session {frame.session_id} epoch "
                                                    f"{frame.epoch}: open it (OpenSession) first")
            self._check_sender(kind, sess, peer)
            if kind == "generate":
                if not self.info.is_first:
                    raise WireFault(pb.BAD_FRAME, "generate frames go to stage 0 only")
                with self.lock:
                    sess.client = reply
                    sess.max_new = frame.generate.max_new_tokens
                    sess.stop_ids = frozenset(frame.generate.stop_token_ids)
                    sess.context_ids = list(frame.generate.context_ids)
                    sess.text = frame.generate.context_text
                    sess.last_used = time.monotonic()
                self._start_speculation(sess, frame.generate)
                return
            if kind != "step":
                raise WireFault(pb.BAD_FRAME, f"unexpected frame body {kind!r}")
            x = self._check_step(frame.step, sess)
        except WireFault as f:
            if f.code == pb.WRONG_STAGE:
                log.warning("refused a frame: %s", f.message)
            self._reply_error(reply, frame, self._err(f.code, f.message, held=f.held, expected=f.expected,
                                                      retry_after_ms=f.retry_after_ms))
            return
        if transit:
            self.metrics.transit["step"].observe(transit / 1e9)
        if x is not None:
            self.metrics.seam_in.inc(len(frame.step.boundary.data))
        if self.info.is_first:
            with self.lock:
                if sess.client is None:
                    sess.client = reply
                sess.history.extend(frame.step.token_ids)      # what draft sources look up
            frame.origin_sent_ns = time.monotonic_ns()
        self._enqueue(Work(frame, reply, time.monotonic_ns(), x, transit), sess)

    def _start_speculation(self, sess: Session, g: pb.Generate) -> None:
        """Origin: a Generate frame that asks for drafts gets its session's draft source, if every hop of
        the route can roll back rejected drafts."""
        if not g.draft_source:
            return
        try:
            k = check_k(g.draft_k or DEFAULT_DRAFT_K)
            drafter = make_source(g.draft_source)
        except DgrError as err:
            raise WireFault(pb.BAD_FRAME, str(err)) from None
        if not sess.can_roll_back:
            raise WireFault(pb.ENGINE, f"speculative decoding needs every stage to drop rejected drafts from its "
                                       f"cache, and {sess.no_roll_back or 'a hop of the route'} cannot (a recurrent "
                                       "or hybrid model keeps one running state, or the worker predates "
                                       "speculation): generate without --speculate")
        sess.drafter, sess.draft_k = drafter, min(k, sess.spec_cap - 1)

    def _check_step(self, step: pb.Step, sess: Session) -> np.ndarray | None:
        """Refuse malformed frames before they reach the engine queue; returns the decoded boundary."""
        info = self.info
        n = len(step.positions)
        if n == 0:
            raise WireFault(pb.BAD_FRAME, "a step needs at least one position")
        p0 = step.positions[0]
        if list(step.positions) != list(range(p0, p0 + n)):
            raise WireFault(pb.BAD_FRAME, "positions must be contiguous and increasing")
        if step.cache_expect != p0:
            raise WireFault(pb.BAD_FRAME, f"cache_expect {step.cache_expect} != first position {p0}")
        if p0 + n > info.n_ctx:
            raise WireFault(pb.ENGINE, context_full(p0 + n - 1, info.n_ctx))
        if step.drafts and (step.drafts >= n or not step.sample):
            raise WireFault(pb.BAD_FRAME, f"a speculative step carries its last token and then {step.drafts} "
                                          f"drafts ({step.drafts + 1} positions, sampled), got {n} positions")
        if info.is_first:
            if step.drafts or step.rollback:
                raise WireFault(pb.BAD_FRAME, "drafts and rollbacks are the origin's own steps: a client sends "
                                              "Generate(draft_source=...) instead")
            if len(step.token_ids) != n:
                raise WireFault(pb.BAD_FRAME, f"stage 0 needs one token id per position ({n}), got "
                                              f"{len(step.token_ids)}")
            if step.HasField("boundary"):
                raise WireFault(pb.SCHEMA_MISMATCH, "stage 0 takes token ids, not a boundary")
            return None
        want = self.schema_in()
        if not step.HasField("schema"):
            raise WireFault(pb.SCHEMA_MISMATCH, f"the frame names no schema; this stage takes {schema_str(want)}")
        diff = schema_diff(step.schema, want)
        if diff:
            raise WireFault(pb.SCHEMA_MISMATCH, f"frame schema {schema_str(step.schema)} differs from this "
                                                f"stage's {schema_str(want)} in {', '.join(diff)}")
        if step.schema.layer != want.layer:
            raise WireFault(pb.WRONG_RANGE, f"the boundary is for layer {step.schema.layer} but this stage "
                                            f"owns [{info.layer_begin}, {info.layer_end})")
        if info.needs_token_ids and len(step.token_ids) != n:
            raise WireFault(pb.SCHEMA_MISMATCH, f"this stage owns token-id layers and needs the token-id "
                                                f"sideband ({n} ids), got {len(step.token_ids)}")
        b = step.boundary
        shape = [n, info.n_streams, info.n_embd]
        if list(b.shape) != shape:
            raise WireFault(pb.BAD_FRAME, f"boundary shape {list(b.shape)} != {shape} "
                                          "[n_tokens, n_streams, n_embd]")
        if b.dtype != want.dtype:
            raise WireFault(pb.SCHEMA_MISMATCH, f"boundary dtype {codec.DTYPE_NAMES.get(b.dtype, b.dtype)} "
                                                f"!= schema dtype {codec.DTYPE_NAMES[want.dtype]}")
        try:
            return codec.decode(b)
        except ValueError as err:
            raise WireFault(pb.BAD_FRAME, str(err)) from None

    # ------------------------------------------------------------------ bounded resources
    def _reap_loop(self) -> None:
        ttl = self.limits.session_ttl_s
        if ttl <= 0:
            return
        while not self.stopping:
            time.sleep(min(1.0, ttl / 4))
            self.reap_idle()

    def _last_used(self, key, sess: Session) -> float:
        """When a session last did anything here: its last gRPC step, or its last native one."""
        if self.native is None or not sess.native:
            return sess.last_used
        return max(sess.last_used, self.native.last_used_ns(*key) / 1e9)

    def reap_idle(self) -> int:
        """Close every session idle for session_ttl_s (opened and never used counts), freeing its cache."""
        ttl = self.limits.session_ttl_s
        now = time.monotonic()
        with self.lock:
            idle = [(k, v) for k, v in self.sessions.items()
                    if now - self._last_used(k, v) >= ttl and k not in self.pending]
        for (sid, epoch), sess in idle:
            log.info("reaping session %s epoch %d: idle for %.1f s (--session-ttl %g), %d positions freed",
                     sid, epoch, now - sess.last_used, ttl, sess.held)
            if sess.client is not None and not sess.done:
                sess.failed = True
                sess.client.put(pb.Frame(session_id=sid, epoch=epoch, error=self._err(
                    pb.UNKNOWN_SESSION, f"session {sid} epoch {epoch} was closed after {ttl:g} s idle "
                                        "(--session-ttl): open it again")))
            self._close_local(sid, epoch)
            with self.lock:
                self.reaped_sessions += 1
        return len(idle)

    # ------------------------------------------------------------------ lifecycle
    def stop(self) -> None:
        self.stopping = True
        if self.native is not None:                     # before the engine it drives is closed
            self.native.stop()
        with self.lock:
            self.wake.notify_all()
            links = list(self.links.values())
        for link in links:
            link.close()
        httpd, self.metrics_server = getattr(self, "metrics_server", None), None
        if httpd is not None:                           # the metrics endpoint (dgr.wire.worker.start_metrics)
            httpd.shutdown()
            httpd.server_close()
