"""Generation control at stage 0, the route's origin: tokens back from the ring, the next step, the client.

A token that comes back around the ring is counted against the session's `max_new_tokens` and stop
ids; the origin queues the next decode step first (the ring goes on), then detokenizes on the engine
thread and streams the token with its text to the client. Errors and logits rows pass straight to the
client. When the client's stream goes away, its unfinished sessions are closed along the route.
"""

from __future__ import annotations

import queue
import threading
import time

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
                    pb.ENGINE, context_full(pos, self.info.n_ctx))))
            else:
                nxt = pb.Frame(session_id=sess.session_id, epoch=sess.epoch, origin_sent_ns=time.monotonic_ns(),
                               step=pb.Step(positions=[pos], token_ids=[tok.token_id], cache_expect=pos,
                                            sample=True))
                self._enqueue(Work(nxt, sess.client, time.monotonic_ns()), sess, own=True)
        else:
            sess.done = True
        # Detokenize on the engine thread once the next step's forward has started: text never delays
        # the ring, and the engine is never called from two threads.
        self._defer(lambda n=len(sess.context_ids): self._send_token(sess, frame, n))

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
