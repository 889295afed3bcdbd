"""Generation control at stage 0, the route's origin: tokens back from the ring, the next step, the client.

A token that comes back around the ring is counted against the session's `max_new_tokens` and stop
ids; the origin queues the next decode step first (the ring goes on), then detokenizes on the engine
thread and streams the token with its text to the client. With speculation the next step also carries
the drafts the session's source (dgr.wire.drafts) proposes, and a ring may return several tokens.
Errors and logits rows pass straight to the client. When the client's stream goes away, its unfinished
sessions are closed along the route.
"""

from __future__ import annotations

import queue
import threading
import time

from dgr.wire import native
from dgr.wire.codec import hop_name
from dgr.wire.gen import stage_pb2 as pb
from dgr.wire.state import Session, StageState, Work


def context_full(position: int, n_ctx: int) -> str:
    """The error of a session that reaches the context limit: what the limit is and how to raise it."""
    return (f"the session reached the context limit: position {position} is beyond the {n_ctx} positions "
            f"(0..{n_ctx - 1}) a session may hold on this worker; start the workers with a larger "
            f"`dgr worker serve --n-ctx N` (every stage of the route), or use a shorter prompt or fewer tokens")


class Origin(StageState):
    """The origin's part of a StageWorker. It queues steps and defers jobs through `_enqueue` and
    `_defer` (dgr.wire.scheduler) and closes sessions with `CloseSession` (dgr.wire.servicer)."""

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
        if tok.origin_sent_ns:                          # (a native token comes with its ring time)
            tok.ring_ns = time.monotonic_ns() - tok.origin_sent_ns
        # A speculative ring returns several draws: the accepted drafts, then token_id. Count them one by
        # one; a stop id or max_new_tokens among them ends the generation there (the rest are dropped).
        draws = [*tok.accepted, tok.token_id]
        first = tok.position - len(tok.accepted)
        if sess.drafter is not None and tok.drafted:
            sess.drafter.observe(tok.drafted, len(tok.accepted))
        used = 0
        for t in draws:
            used += 1
            sess.produced += 1
            sess.context_ids.append(t)
            sess.history.append(t)
            if t in sess.stop_ids or sess.produced >= sess.max_new:
                break
        last = draws[used - 1]
        tok.done = last in sess.stop_ids or sess.produced >= sess.max_new
        pos = first + used
        if not tok.done and not sess.failed:
            # queue the next decode step first: the ring goes on while this token is detokenized and sent
            if pos >= self.info.n_ctx:
                sess.failed = True
                sess.client.put(pb.Frame(session_id=sess.session_id, epoch=sess.epoch, error=self._err(
                    pb.ENGINE, context_full(pos, self.info.n_ctx))))
            elif sess.native_decoding:
                pass                                    # the native plane queued the next step itself
            elif sess.native and sess.drafter is None:
                # the prefill's token is back: the rest of the decode goes round the native plane
                sess.native_decoding = True
                self.native.decode(sess.session_id, sess.epoch, pos, last, sess.max_new - sess.produced,
                                   sess.stop_ids)
            else:
                self._enqueue(Work(self._next_step(sess, pos, last, bool(tok.drafted)), sess.client,
                                   time.monotonic_ns()), sess, own=True)
        else:
            sess.done = True
        frames = self._client_frames(frame, draws[:used], first)
        # Detokenize on the engine thread once the next step's forward has started: text never delays
        # the ring, and the engine is never called from two threads.
        n0 = len(sess.context_ids) - len(frames)
        self._defer(lambda: [self._send_token(sess, f, n0 + i + 1) for i, f in enumerate(frames)])

    def _on_native_event(self, ev, row: bytes = b"") -> None:
        """A token or an error from the native plane (dgr.wire.native): to the client as the gRPC plane's."""
        sid, epoch = ev.session_id.decode(), ev.epoch
        if ev.kind == native.KIND_TOKEN:
            hops = [pb.HopTiming(stage_index=h.stage_index, queue_ns=max(0, h.queue_ns), compute_ns=max(0, h.compute_ns),
                                 wire_ns=max(0, h.wire_ns), transit_ns=max(0, h.transit_ns)) for h in ev.hops[:ev.n_hops]]
            self._deliver_to_client(pb.Frame(session_id=sid, epoch=epoch, token=pb.Token(
                token_id=ev.token_id, position=ev.position, ring_ns=max(0, ev.ring_ns),
                return_ns=max(0, ev.return_ns), timings=hops, logits=row)))
            return
        with self.lock:
            sess = self.sessions.get((sid, epoch))
        if sess is None or sess.failed or sess.done:
            return
        why = ev.message.decode(errors="replace")
        code = {native.E_UNREACHABLE: pb.HOP_UNREACHABLE, native.E_CACHE_MISS: pb.CACHE_MISS,
                native.E_UNKNOWN: pb.UNKNOWN_SESSION}.get(ev.error_code, pb.ENGINE)
        if ev.error_code == native.E_CONTEXT_FULL:
            why = context_full(ev.position, self.info.n_ctx)
        # name the hop at fault: the one a stage could not write to, else the one that reports
        at = ev.stage_index + 1 if ev.error_code == native.E_UNREACHABLE else ev.stage_index
        at = min(max(at, 0), len(sess.route) - 1)
        name = hop_name(at, sess.route[at].address)
        self._count_error(code)
        self._deliver_to_client(pb.Frame(session_id=sid, epoch=epoch, error=pb.WireError(
            code=code, hop=name, message=f"{name}: native plane: {why}")))

    def _next_step(self, sess: Session, pos: int, token: int, after_drafts: bool) -> pb.Frame:
        """The next decode step: the last token at `pos`, plus what the session's draft source proposes
        (speculation: k+1 positions, verified by the last stage in the same ring). `after_drafts`: the
        step answered was speculative, so stages may hold rejected positions >= pos to drop."""
        drafts: list[int] = []
        if sess.drafter is not None:
            k = min(sess.draft_k, sess.max_new - sess.produced - 1, self.info.n_ctx - 1 - pos)
            if k > 0:
                drafts = list(sess.drafter.propose(sess.history, k))[:k]
        n = 1 + len(drafts)
        return pb.Frame(session_id=sess.session_id, epoch=sess.epoch, origin_sent_ns=time.monotonic_ns(),
                        step=pb.Step(positions=range(pos, pos + n), token_ids=[token, *drafts], cache_expect=pos,
                                     sample=True, drafts=len(drafts), rollback=after_drafts))

    def _client_frames(self, frame: pb.Frame, draws: list[int], first: int) -> list[pb.Frame]:
        """What the client gets for one ring: a Token per draw (accepted drafts marked `speculated`), the
        ring's own frame (timings, ring time) last. LOGITS_LAST rows are split among them."""
        tok = frame.token
        rows = None
        if tok.logits and tok.accepted:
            width = len(tok.logits) // (len(tok.accepted) + 1)
            rows = [tok.logits[i * width:(i + 1) * width] for i in range(len(draws))]
        out = [pb.Frame(session_id=frame.session_id, epoch=frame.epoch, token=pb.Token(
            token_id=t, position=first + i, speculated=True, logits=rows[i] if rows else b""))
            for i, t in enumerate(draws[:-1])]
        tok.token_id, tok.position = draws[-1], first + len(draws) - 1
        del tok.accepted[len(draws) - 1:]
        if rows:
            tok.logits = rows[-1]
        return [*out, frame]

    def _send_token(self, sess: Session, frame: pb.Frame, n_ids: int) -> None:
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

    def _client_gone(self, out: queue.Queue) -> None:
        """The client's stream ended: stop decoding for it and free its sessions along the route."""
        with self.lock:
            orphans = [k for k, v in self.sessions.items() if v.client is out and not v.done]
            for k in orphans:
                self.sessions[k].failed = True
        for sid, epoch in orphans:
            threading.Thread(target=self.CloseSession, args=(
                pb.CloseSessionRequest(session_id=sid, epoch=epoch, chain=True), None), daemon=True).start()
