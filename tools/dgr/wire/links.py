"""Frames out of a stage worker: results cut into frames, and the streams that carry them to the next hop.

A middle stage's result becomes boundary frames for the next hop; the last stage samples and sends the
token (and any logits rows) straight to the origin. All sessions going to one peer share one outgoing
Frames stream (`Link`); its reader thread hands the peer's error replies to the origin and notices when
the peer dies (HOP_UNREACHABLE for every session that was using it).
"""

from __future__ import annotations

import queue
import threading
import time

import grpc

from dgr.log import get_logger
from dgr.wire import codec, tls
from dgr.wire.codec import hop_name
from dgr.wire.gen import stage_pb2 as pb
from dgr.wire.gen import stage_pb2_grpc as pb_grpc
from dgr.wire.sampling import sample
from dgr.wire.state import END, Session, StageState, Work

log = get_logger(__name__)


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    # gRPC itself enforces the limit on both ends, so an oversized frame can never pass silently.
    limit = max_message_bytes + codec.FRAME_OVERHEAD
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]


# A link pings its peer every second and gives up 2 s (Limits.link_keepalive_timeout_s, `dgr worker serve
# --link-keepalive-timeout`) after an unanswered ping: a dead or stopped next hop (SIGSTOP keeps the TCP
# connection up) is noticed within ~3 s, not at the next TCP timeout. (gRPC >= 1.6x times an unanswered
# ping out after grpc.http2.ping_timeout_ms, 60 s by default: set it too.)
LINK_KEEPALIVE_MS = 1000


def link_options(max_message_bytes: int, keepalive_timeout_ms: int = 2000) -> list[tuple[str, int]]:
    """A worker's channel to a peer (next hop, origin): message limits plus keepalive."""
    # reconnect soon to a peer restarted in place (gRPC's default backoff starts at 1 s and grows to 120 s)
    return [*channel_options(max_message_bytes), ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.min_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000),
            ("grpc.keepalive_time_ms", LINK_KEEPALIVE_MS),
            ("grpc.keepalive_timeout_ms", keepalive_timeout_ms), ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0), ("grpc.http2.min_time_between_pings_ms", LINK_KEEPALIVE_MS),
            ("grpc.http2.min_ping_interval_without_data_ms", LINK_KEEPALIVE_MS),
            ("grpc.http2.ping_timeout_ms", keepalive_timeout_ms)]


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """A worker's server: message limits, the links' (and clients') pings permitted, and its own pings
    to callers so that a stopped caller's streams end too."""
    return [*channel_options(max_message_bytes), ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", LINK_KEEPALIVE_MS // 2),
            ("grpc.http2.max_ping_strikes", 0), ("grpc.http2.max_pings_without_data", 0),
            ("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000)]


class Link:
    """An outgoing Frames stream to one peer, shared by all sessions going there."""

    def __init__(self, worker: Links, address: str, label: str):
        self.worker, self.address, self.label = worker, address, label
        self.channel = tls.channel(address, worker.tls, link_options(
            worker.max_message_bytes, int(worker.limits.link_keepalive_timeout_s * 1000)))
        self.stub = pb_grpc.StageStub(self.channel)
        self.lock = threading.Lock()
        self.q: queue.Queue | None = None
        self.sessions: set = set()

    def send(self, frame: pb.Frame) -> None:
        with self.lock:
            if self.q is None:
                self.q = queue.Queue()
                self.sessions = set()
                call = self.stub.Frames(iter(self.q.get, END))
                threading.Thread(target=self._read, args=(call, self.q), daemon=True,
                                 name=f"link-{self.address}").start()
            self.sessions.add((frame.session_id, frame.epoch))
            self.q.put(frame)

    def _read(self, call, q) -> None:
        why = "closed the stream"
        try:
            for reply in call:
                self.worker._on_link_reply(self, reply)
        except grpc.RpcError as err:
            why = f"{err.code().name}: {err.details() or ''}"
        with self.lock:
            lost, self.sessions = self.sessions, set()
            if self.q is q:
                self.q = None                           # the next frame opens a new stream
        q.put(END)                                      # release gRPC's request-consuming thread
        if not self.worker.stopping:
            # the next frame to this peer gets a new channel: this one may sit in gRPC's reconnect backoff
            # (after "connection refused" from a peer being restarted) and fail the next stream at once,
            # though the peer is back at the same address
            self.worker._forget_link(self)
            self.worker._on_link_broken(self, why, lost)

    def close(self) -> None:
        with self.lock:
            if self.q is not None:
                self.q.put(END)
                self.q = None
        self.channel.close()


class Links(StageState):
    """The outgoing side of a StageWorker. Frames that return into this worker (a one-stage route) go to
    `_on_frame` (dgr.wire.servicer), and frames for the client to `_deliver_to_client` (dgr.wire.origin)."""

    def _init_links(self) -> None:
        self.links: dict[str, Link] = {}
        self.max_frame_bytes_sent = 0

    def _emit_boundary(self, w: Work, sess: Session, res, timing: pb.HopTiming) -> None:
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
                           cache_expect=s.positions[lo], sample=s.sample and hi == n,
                           drafts=s.drafts if hi == n else 0, rollback=s.rollback and lo == 0)
            self.metrics.seam_out.inc(len(step.boundary.data))
            frames.append(pb.Frame(session_id=sess.session_id, epoch=sess.epoch, step=step,
                                   origin_sent_ns=w.frame.origin_sent_ns, timings=w.frame.timings))
        timing.wire_ns = time.monotonic_ns() - t0
        for f in frames:
            f.timings.append(timing)
            self._send(nxt.address, sess.hop_index + 1, f, sess)

    def _emit_last(self, w: Work, sess: Session, res, timing: pb.HopTiming) -> None:
        t0 = time.monotonic_ns()
        s = w.frame.step
        origin = sess.route[0].address
        frames = []
        draws, rows, valid = [], None, len(s.positions)
        if s.sample:
            draws, rows = self._verify(s, sess, res.logits)
            valid -= s.drafts + 1 - len(draws)          # positions computed from rejected drafts: no rows
        if sess.logits == pb.LOGITS_ALL and res.logits is not None and len(res.logits):
            rows_per = max(1, (self.max_message_bytes - codec.FRAME_OVERHEAD) // (self.info.n_vocab * 4 + 8))
            for lo in range(0, valid, rows_per):
                part = res.logits[lo:min(valid, lo + rows_per)]
                frames.append(pb.Frame(session_id=sess.session_id, epoch=sess.epoch, logits=pb.Logits(
                    positions=s.positions[lo:lo + len(part)], values=part.astype("<f4").tobytes())))
        if s.sample:
            pos = s.positions[-(s.drafts + 1)] + len(draws) - 1
            self.metrics.sampled.inc(len(draws))
            token = pb.Token(token_id=draws[-1], position=pos, origin_sent_ns=w.frame.origin_sent_ns,
                             accepted=draws[:-1], drafted=s.drafts)
            if sess.logits == pb.LOGITS_LAST:
                token.logits = rows[:len(draws)].astype("<f4").tobytes()
            frames.append(pb.Frame(session_id=sess.session_id, epoch=sess.epoch, token=token,
                                   origin_sent_ns=w.frame.origin_sent_ns, timings=w.frame.timings))
        timing.wire_ns = time.monotonic_ns() - t0
        for f in frames:
            if f.HasField("token"):
                f.timings.append(timing)
                f.token.timings.extend(f.timings)
            self._send(origin, 0, f, sess)

    @staticmethod
    def _verify(s: pb.Step, sess: Session, logits):
        """The draws of a sampled step: at each of its last drafts+1 positions the token a plain decode
        would draw there (greedy argmax, or the (seed, position)-keyed draw), while they match the drafts;
        the first mismatch (or the position after the last draft) gives the next token. Returns the draws
        (accepted drafts, then that token) and the step's rows they came from."""
        k, sp = s.drafts, sess.sampling
        rows = logits[-(k + 1):]
        base = s.positions[len(s.positions) - k - 1]
        drafted = s.token_ids[len(s.token_ids) - k:] if k else []
        draws = []
        for j, row in enumerate(rows):
            draws.append(sample(row, temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, seed=sp.seed,
                                position=base + j))
            if j == k or draws[-1] != drafted[j]:
                break
        return draws, rows

    def _send(self, address: str, hop_index: int, frame: pb.Frame, sess: Session) -> None:
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

    def _link(self, address: str, hop_index: int) -> Link:
        with self.lock:
            link = self.links.get(address)
            if link is None:
                link = self.links[address] = Link(self, address, hop_name(hop_index, address))
            return link

    def _forget_link(self, link: Link) -> None:
        """A broken link is not reused (its channel is left to close when the last sender lets go)."""
        with self.lock:
            if self.links.get(link.address) is link:
                del self.links[link.address]

    def _to_origin(self, sess: Session, frame: pb.Frame) -> None:
        if self.info.is_first:
            self._deliver_to_client(frame)
        else:
            self._send(sess.route[0].address, 0, frame, sess)

    def _on_link_reply(self, link: Link, frame: pb.Frame) -> None:
        """A peer answered an error about a frame this worker sent: hand it to the origin."""
        with self.lock:
            sess = self.sessions.get((frame.session_id, frame.epoch))
        if sess is not None:
            self._to_origin(sess, frame)

    def _on_link_broken(self, link: Link, why: str, lost: set) -> None:
        with self.lock:
            sessions = [self.sessions[k] for k in lost if k in self.sessions]
        for sess in sessions:
            idx = next((i for i, h in enumerate(sess.route) if h.address == link.address), -1)
            name = hop_name(idx, link.address) if idx >= 0 else link.address
            e = pb.WireError(code=pb.HOP_UNREACHABLE, hop=name, message=(
                f"{name} is unreachable: {self.hop} lost its stream to it ({why}); that worker died, stopped "
                f"answering (keepalive {LINK_KEEPALIVE_MS + int(self.limits.link_keepalive_timeout_s * 1000)} ms) "
                "or shut down (a thin link carrying a long prompt: raise --link-keepalive-timeout): use "
                "another replica or restart it"))
            frame = pb.Frame(session_id=sess.session_id, epoch=sess.epoch, error=e)
            if link.address != sess.route[0].address:
                self._count_error(pb.HOP_UNREACHABLE)
                self._to_origin(sess, frame)
            elif not sess.told_origin:
                # The stream back to the origin broke (the origin died, or a ping went unanswered on a
                # starved machine): the ring's token may be lost, and a live origin would wait for it
                # until the client's timeout. Say so on a new stream (the broken link is forgotten):
                # a live origin hands the error to the client, which re-routes; a dead one fails that
                # stream too, and nothing is retried (once per session).
                sess.told_origin = True
                self._count_error(pb.HOP_UNREACHABLE)
                frame.error.hop, frame.error.message = self.hop, (
                    f"{self.hop} lost its stream back to the origin {name} ({why}): the ring's last token may "
                    "be lost; the session goes on in a new epoch")
                log.warning("stream to the origin broke for session %s: %s; telling the origin on a new stream",
                            sess.session_id, why)
                self._to_origin(sess, frame)
            else:
                log.warning("origin unreachable for session %s: %s", sess.session_id, e.message)

