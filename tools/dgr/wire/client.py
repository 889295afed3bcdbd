"""The route client: opens a session along a route of stage workers, streams a prompt into stage 0 in
chunks, and receives the tokens that come back around the ring. On a cache miss anywhere it re-prefills
from its token history at a new epoch. Shares nothing with the worker but the generated stubs."""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import numpy as np

from dgr.errors import WireError
from dgr.log import get_logger
from dgr.wire import codec
from dgr.wire.codec import hop_name
from dgr.wire.errors import HopUnreachable, RemoteCacheMiss, StageError, UnknownSession, from_proto
from dgr.wire.gen import stage_pb2 as pb
from dgr.wire.gen import stage_pb2_grpc as pb_grpc

log = get_logger(__name__)

_END = object()
LOGITS = {"none": pb.LOGITS_NONE, "last": pb.LOGITS_LAST, "all": pb.LOGITS_ALL}


@dataclass
class TokenEvent:
    token_id: int
    text: str
    position: int
    epoch: int
    ring_ns: int
    compute_ns: int                      # summed over the stages this token passed through
    logits: np.ndarray | None = None     # LOGITS_LAST: the row the token was sampled from
    # per stage: (stage, transit in, queue, compute, encode+send) in ns
    timings: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    return_ns: int = 0                   # transit of the token from the last stage to the origin


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logits: dict[int, np.ndarray] = field(default_factory=dict)   # position -> row
    events: list[TokenEvent] = field(default_factory=list)
    epochs: int = 0
    chunk_tokens: int = 0                # prefill tokens per step, the same at every stage
    t_start: float = 0.0
    t_first: float = 0.0
    t_last: float = 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        dt = self.t_first - self.t_start
        return len(self.prompt_ids) / dt if dt > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        dt = self.t_last - self.t_first
        return (len(self.token_ids) - 1) / dt if dt > 0 and len(self.token_ids) > 1 else 0.0


class RouteClient:
    def __init__(self, route: list[str], *, max_message_bytes: int = codec.DEFAULT_MAX_MESSAGE_BYTES,
                 timeout: float = 120.0, chunk_tokens: int = 64):
        if not route:
            raise WireError("the route is empty: give HOST:PORT of every stage, stage 0 first")
        self.route = list(route)
        self.max_message_bytes = max_message_bytes
        self.timeout = timeout
        self.chunk_tokens = max(1, min(chunk_tokens, codec.tokens_per_frame(max_message_bytes, 0)))
        limit = max_message_bytes + codec.FRAME_OVERHEAD
        opts = [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]
        self.channels = [grpc.insecure_channel(a, options=opts) for a in self.route]
        self.stubs = [pb_grpc.StageStub(c) for c in self.channels]
        self.max_frame_bytes_sent = 0
        self._hops: list[pb.StageDescription] | None = None

    def close(self) -> None:
        for c in self.channels:
            c.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def hop(self, i: int) -> str:
        return hop_name(i, self.route[i])

    @property
    def hops(self) -> list[pb.StageDescription]:
        """What every hop said of itself, stage 0 first: the last `describe()`, made on first use.
        Sessions open on what these say (bundle, stage, range of each hop)."""
        if self._hops is None:
            self.describe()
        return self._hops

    # ------------------------------------------------------------------ control
    def describe(self, timeout: float = 10.0) -> list[pb.StageDescription]:
        out = []
        for i, stub in enumerate(self.stubs):
            try:
                out.append(stub.Describe(pb.DescribeRequest(), timeout=timeout))
            except grpc.RpcError as err:
                raise HopUnreachable(f"cannot reach the worker: {err.code().name}: is it running?",
                                     hop=self.hop(i)) from None
        self._hops = out
        # Every stage processes the same chunks (no hop re-splits a chunk to fit its message limit), so
        # prefill follows one schedule end to end and a baseline chunked alike is comparable bit for bit
        # (llama.cpp's kernels are not batch-size invariant).
        for d in out:
            if d.HasField("schema_out") and d.seam_bytes_per_token:
                self.chunk_tokens = min(self.chunk_tokens, codec.tokens_per_frame(
                    min(d.max_message_bytes, self.max_message_bytes), d.seam_bytes_per_token))
        return out

    def _vocab_stub(self) -> pb_grpc.StageStub:
        hops = self.hops
        for d, stub in zip(hops, self.stubs):
            if d.has_vocab:
                return stub
        raise WireError("no stage of the route holds the vocabulary: cannot tokenize")

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return list(self._vocab_stub().Tokenize(pb.TokenizeRequest(text=text, add_special=add_special),
                                                timeout=30).token_ids)

    def detokenize(self, ids: list[int]) -> str:
        return self._vocab_stub().Detokenize(pb.DetokenizeRequest(token_ids=ids), timeout=30).text

    def open(self, session_id: str, epoch: int, sampling: pb.Sampling, logits: int) -> list[pb.StageDescription]:
        hops = self.hops
        route = [pb.Hop(address=a, bundle_id=d.identity.bundle_id, stage_index=d.identity.stage_index,
                        layer_begin=d.identity.layer_begin, layer_end=d.identity.layer_end)
                 for a, d in zip(self.route, hops)]
        req = pb.OpenSessionRequest(session_id=session_id, epoch=epoch, route=route, hop_index=0,
                                    sampling=sampling, logits=logits)
        try:
            reply = self.stubs[0].OpenSession(req, timeout=120)
        except grpc.RpcError as err:
            raise HopUnreachable(f"cannot open a session: {err.code().name}: is the worker running?",
                                 hop=self.hop(0)) from None
        if reply.HasField("error"):
            raise from_proto(reply.error)
        return list(reply.hops)

    def close_session(self, session_id: str, epoch: int) -> None:
        try:
            self.stubs[0].CloseSession(pb.CloseSessionRequest(session_id=session_id, epoch=epoch, chain=True),
                                       timeout=10)
        except grpc.RpcError:
            pass                                        # best effort: the worker frees it on its own restart

    # ------------------------------------------------------------------ generation
    def generate(self, prompt: str | list[int], *, max_new_tokens: int = 32, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 0.0, seed: int = 0, logits: str = "none",
                 stop_token_ids: list[int] | None = None, max_epochs: int = 4,
                 session_id: str | None = None) -> Iterator[TokenEvent]:
        """Yield tokens as they arrive. `logits`: none | last | all (rows go to `self.last.logits`)."""
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise WireError("the prompt is empty")
        if stop_token_ids is None:
            hops = self.hops
            stop_token_ids = list(hops[-1].eos_token_ids)
        sampling = pb.Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        if self._hops is None:                          # describe before the clock starts
            self.describe()
        gen = self.last = Generation(prompt_ids=ids, t_start=time.perf_counter(), chunk_tokens=self.chunk_tokens)
        sid = session_id or uuid.uuid4().hex
        epoch = 0
        while len(gen.token_ids) < max_new_tokens:
            epoch += 1
            if epoch > max_epochs:
                raise WireError(f"gave up after {max_epochs} epochs of cache misses; is a worker restarting?")
            gen.epochs = epoch
            self.open(sid, epoch, sampling, LOGITS[logits])
            try:
                yield from self._run_epoch(gen, sid, epoch, max_new_tokens, stop_token_ids)
                break
            except (RemoteCacheMiss, UnknownSession) as miss:
                # A hop lost or never had this session's cache (eviction, restart, route change):
                # rebuild it from the token history at a new epoch.
                log.info("%s; re-prefilling %d tokens at epoch %d", miss, len(ids) + len(gen.token_ids),
                         epoch + 1)
            finally:
                self.close_session(sid, epoch)

    def run(self, prompt: str | list[int], **kw) -> Generation:
        for _ in self.generate(prompt, **kw):
            pass
        return self.last

    def _frames(self, gen: Generation, sid: str, epoch: int, max_new: int, stop_ids: list[int]):
        history = gen.prompt_ids + gen.token_ids
        yield pb.Frame(session_id=sid, epoch=epoch, generate=pb.Generate(
            max_new_tokens=max_new - len(gen.token_ids), stop_token_ids=stop_ids,
            context_ids=gen.token_ids, context_text=gen.text))
        for lo in range(0, len(history), self.chunk_tokens):
            hi = min(len(history), lo + self.chunk_tokens)
            f = pb.Frame(session_id=sid, epoch=epoch, step=pb.Step(
                positions=range(lo, hi), token_ids=history[lo:hi], cache_expect=lo,
                sample=hi == len(history)))
            size = f.ByteSize()
            if size > self.max_message_bytes:
                raise WireError(f"a {size}-byte prompt chunk exceeds the message limit; lower chunk_tokens")
            self.max_frame_bytes_sent = max(self.max_frame_bytes_sent, size)
            yield f

    def _run_epoch(self, gen: Generation, sid: str, epoch: int, max_new: int, stop_ids: list[int]):
        q: queue.Queue = queue.Queue()
        outgoing: queue.Queue = queue.Queue()
        for f in self._frames(gen, sid, epoch, max_new, stop_ids):
            outgoing.put(f)
        if epoch == 1:
            gen.t_start = time.perf_counter()           # prefill time starts with the first chunk sent
        call = self.stubs[0].Frames(iter(outgoing.get, _END))

        def read():
            try:
                for reply in call:
                    q.put(reply)
            except grpc.RpcError as err:
                q.put(err)
            q.put(_END)

        threading.Thread(target=read, daemon=True, name="client-frames").start()
        try:
            while True:
                try:
                    item = q.get(timeout=self.timeout)
                except queue.Empty:
                    raise self._diagnose(f"no reply from the route within {self.timeout:.0f} s") from None
                if item is _END:
                    raise self._diagnose("stage 0 closed the stream before the generation finished")
                if isinstance(item, grpc.RpcError):
                    raise HopUnreachable(f"the stream broke: {item.code().name} {item.details() or ''}: "
                                         "that worker may have died", hop=self.hop(0)) from None
                kind = item.WhichOneof("body")
                if kind == "error":
                    raise from_proto(item.error)
                if kind == "logits":
                    rows = np.frombuffer(item.logits.values, dtype="<f4").reshape(len(item.logits.positions), -1)
                    for p, row in zip(item.logits.positions, rows):
                        gen.logits[p] = row
                    continue
                if kind != "token":
                    continue
                t = item.token
                now = time.perf_counter()
                if not gen.token_ids:
                    gen.t_first = now
                gen.t_last = now
                row = np.frombuffer(t.logits, dtype="<f4").astype(np.float32) if t.logits else None
                if row is not None:
                    gen.logits[t.position] = row
                ev = TokenEvent(t.token_id, t.text, t.position, epoch, t.ring_ns,
                                sum(h.compute_ns for h in t.timings), row,
                                [(h.stage_index, h.transit_ns, h.queue_ns, h.compute_ns, h.wire_ns)
                                 for h in t.timings], t.return_ns)
                gen.token_ids.append(t.token_id)
                gen.text += t.text
                gen.events.append(ev)
                yield ev
                if t.done:
                    return
        finally:
            outgoing.put(_END)
            call.cancel()

    def _diagnose(self, what: str) -> StageError:
        """Find which hop is down, so the error names it."""
        for i, stub in enumerate(self.stubs):
            try:
                stub.Describe(pb.DescribeRequest(), timeout=3)
            except grpc.RpcError as err:
                return HopUnreachable(f"{what}; this worker does not answer ({err.code().name}): restart it",
                                      hop=self.hop(i))
        return StageError(f"{what}; every hop answers Describe: a worker may be stuck (see their logs)",
                          hop="route " + ",".join(self.route))
