"""The route client: opens a session along a route of stage workers, streams a prompt into stage 0 in
chunks, receives the tokens that come back around the ring, and keeps generating through faults.

A route lists, per stage, replicas in preference order (`parse_route("A,B1|B2,C")`). When a hop dies,
stops answering or loses the session's cache, the client moves that stage to its next replica (or asks
a `RouteSource`), opens a new epoch and re-prefills from its token history (prompt + tokens so far):
the text goes on without a gap or a repeat, up to `attempts` failures. Liveness: while it waits for a
reply, every `hop_deadline` seconds without one it probes every hop (Describe, same deadline); a hop
that does not answer is named and routed around. Opening the route can wait for hops that are not up
yet (`connect_wait`: a worker starting or restarted in place). Shares nothing with the worker but the stubs.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence

import grpc
import numpy as np

from dgr.core.errors import WireError
from dgr.core.log import get_logger
from dgr.runtime.wire import codec, tls as wtls
from dgr.runtime.wire.codec import hop_name
from dgr.runtime.wire.drafts import DEFAULT_DRAFT_K, check_k, check_source
from dgr.runtime.wire.errors import (RECOVERABLE, HopUnreachable, Overloaded, RemoteSchemaMismatch, StageError,
                                     WrongRange, WrongStage, from_proto, gave_up)
from dgr.runtime.wire.gen import stage_pb2 as pb, stage_pb2_grpc as pb_grpc
from dgr.runtime.wire.hops import Hops
from dgr.runtime.wire.limits import MAX_TOP_LOGPROBS, reconnect_options
from dgr.runtime.wire.prefix import PREFIX_BLOCK_TOKENS, PrefixRoutes, block_hashes, prompt_blocks
from dgr.runtime.wire.routes import parse_route, unreachable
from dgr.runtime.wire.stats import Failure, Generation, TokenEvent

log = get_logger(__name__)

__all__ = ["Failure", "Generation", "RouteClient", "RouteSource", "TokenEvent", "parse_route"]

_END = object()
LOGITS = {"none": pb.LOGITS_NONE, "last": pb.LOGITS_LAST, "all": pb.LOGITS_ALL}
DEFAULT_ATTEMPTS = 6
DEFAULT_HOP_DEADLINE = 3.0

# The hook the mesh's router supplies: asked for a replacement of stage `i` once the listed replicas are
# used up, with every address already tried for that stage (in order); returns another HOST:PORT or None.
RouteSource = Callable[[int, list[str]], "str | None"]


def _result(fut: grpc.Future, t: float):
    try:
        return fut.result(timeout=t)
    except grpc.FutureTimeoutError:
        raise queue.Empty from None


class RouteClient(Hops):
    """`route`: HOST:PORT per stage, or a list of replicas per stage (preference order), or route text
    (`parse_route`). `timeout`: the longest wait for one token of a route that answers probes;
    `hop_deadline`: the deadline of liveness probes and the silence that triggers them; `attempts`:
    failures recovered from before giving up; `tls`: this side's certificate (and CA) for every channel.
    `connect_wait`: seconds to wait, when the route is opened (each stage's first Describe), for a stage
    none of whose replicas is up yet (connection refused, no answer: a worker starting or restarted in
    place), retrying with a growing pause and logging one line per stage and reason; then the error names
    the stage. 0 (the default) fails at once, as a gateway or a benchmark wants; `dgr generate` waits up
    to its `--timeout`. A TLS refusal or a wrong stage is never waited for. `allow_mixed_numerics`: accept
    stages (and replicas) whose engines compute different bits (MixedNumerics otherwise); `exact` and each
    Generation's `exact` then say whether the route mixed them."""

    def __init__(self, route: str | Sequence[str | Sequence[str]], *,
                 max_message_bytes: int = codec.DEFAULT_MAX_MESSAGE_BYTES, timeout: float = 120.0,
                 chunk_tokens: int = 64, tls: wtls.TlsConfig | None = None,
                 hop_deadline: float = DEFAULT_HOP_DEADLINE, attempts: int = DEFAULT_ATTEMPTS,
                 route_source: RouteSource | None = None, connect_wait: float = 0.0, prefix_cache: bool = True,
                 prefix_routes: PrefixRoutes | None = None, allow_mixed_numerics: bool = False):
        reps = parse_route(route) if isinstance(route, str) else \
            [[r] if isinstance(r, str) else list(dict.fromkeys(r)) for r in route]
        if not reps or not all(reps):
            raise WireError("the route is empty: give HOST:PORT of every stage, stage 0 first")
        self.replicas = reps
        self.route = [r[0] for r in reps]               # the replica each stage uses now
        self.max_message_bytes = max_message_bytes
        self.timeout = timeout
        self.hop_deadline = hop_deadline
        self.attempts = attempts
        self.connect_wait = connect_wait
        self.prefix_cache = prefix_cache                # generate()'s default (measurements turn it off: cold prefill)
        self.prefix_routes = prefix_routes              # shared: which replicas kept which prefixes
        self.route_source = route_source
        self.tls = tls
        self.chunk_tokens = max(1, min(chunk_tokens, codec.tokens_per_frame(max_message_bytes, 0)))
        limit = max_message_bytes + codec.FRAME_OVERHEAD
        # reconnect soon to a worker restarted in place (gRPC's default backoff starts at 1 s, grows to 120 s)
        self._opts = [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit),
                      *reconnect_options()]
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, pb_grpc.StageStub] = {}
        self.max_frame_bytes_sent = 0
        self.cached_tokens = 0                          # the last open's: positions restored from prefix caches
        self._hops: list[pb.StageDescription | None] | None = None
        self._ident: list[tuple | None] = [None] * len(reps)   # what each stage must serve (first seen)
        # the route's numerics (the first stage described: (stage, numerics)); a hop of others is refused unless
        # `allow_mixed_numerics` (docs/numerics.md), and then `exact` is False and every Generation says so
        self.allow_mixed_numerics = allow_mixed_numerics
        self._numerics: tuple[int, str] | None = None
        self._mixed_seen: set[tuple[int, str]] = set()

    def close(self) -> None:
        for c in self._channels.values():
            c.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _stub(self, address: str) -> pb_grpc.StageStub:
        if address not in self._stubs:
            self._channels[address] = wtls.channel(address, self.tls, self._opts)
            self._stubs[address] = pb_grpc.StageStub(self._channels[address])
        return self._stubs[address]

    def _forget(self, address: str) -> None:
        """Drop the channel to `address`: after "connection refused" it sits in gRPC's reconnect backoff
        and would fail the next call at once, though the worker may be back by then."""
        self._stubs.pop(address, None)
        ch = self._channels.pop(address, None)
        if ch is not None:
            ch.close()

    def _drop_hop(self, i: int) -> None:
        """Stage i did not answer: describe it again, on a new channel, before its next use (its worker may be
        back by then, restarted in place, and the old channel would still sit in gRPC's reconnect backoff)."""
        self._forget(self.route[i])
        if self._hops is not None:
            self._hops[i] = None

    def hop(self, i: int) -> str:
        return hop_name(i, self.route[i])

    @property
    def hops(self) -> list[pb.StageDescription]:
        """What every hop of the current route said of itself, stage 0 first (described on first use).
        Sessions open on what these say (bundle, stage, range of each hop)."""
        if self._hops is None or any(d is None for d in self._hops):
            self.describe(missing_only=True)
        return self._hops

    # ------------------------------------------------------------------ control
    def _vocab_call(self, method: str, req, what: str):
        """`method` (Tokenize, Detokenize) at the first stage that holds the vocabulary, under the liveness
        watch as OpenSession is: a dead or stopped hop is HopUnreachable within the hop deadline (the RPC
        itself may wait for the engine's lock behind a decode step, so its own deadline stays long)."""
        i = next((i for i, d in enumerate(self.hops) if d.has_vocab), None)
        if i is None:
            raise WireError(f"no stage of the route holds the vocabulary: cannot {what}")
        fut = getattr(self._stub(self.route[i]), method).future(req, timeout=30)
        try:
            return self._watch(lambda t: _result(fut, t), f"no answer to {method}", fut.cancel)
        except grpc.RpcError as err:
            dead = unreachable(self.hop(i), f"cannot {what}", err, tls=self.tls is not None)
        except StageError as err:                       # the watch's probe: a hop that does not answer
            dead = err
        self._drop_hop(i if dead.stage is None else dead.stage)
        raise dead

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return list(self._vocab_call("Tokenize", pb.TokenizeRequest(text=text, add_special=add_special),
                                     "tokenize").token_ids)

    def detokenize(self, ids: list[int]) -> str:
        return self._vocab_call("Detokenize", pb.DetokenizeRequest(token_ids=ids), "detokenize").text

    def open(self, session_id: str, epoch: int, sampling: pb.Sampling, logits: int,
             prefix: Sequence[bytes] = ()) -> list[pb.StageDescription]:
        """Open an epoch along the route. `prefix`: the prompt's block hashes (dgr.runtime.wire.prefix.prompt_blocks);
        `self.cached_tokens` then says how many positions every hop restored from its prefix cache."""
        hops = self.hops
        route = [pb.Hop(address=a, bundle_id=d.identity.bundle_id, stage_index=d.identity.stage_index,
                        layer_begin=d.identity.layer_begin, layer_end=d.identity.layer_end)
                 for a, d in zip(self.route, hops)]
        req = pb.OpenSessionRequest(session_id=session_id, epoch=epoch, route=route, hop_index=0,
                                    sampling=sampling, logits=logits, prefix_blocks=list(prefix),
                                    prefix_block_tokens=PREFIX_BLOCK_TOKENS if prefix else 0)
        fut = self._stub(self.route[0]).OpenSession.future(req, timeout=self.timeout)
        try:
            reply = self._watch(lambda t: _result(fut, t), "no answer to OpenSession", fut.cancel)
        except grpc.RpcError as err:
            raise unreachable(self.hop(0), "cannot open a session", err, tls=self.tls is not None) from None
        if reply.HasField("error"):
            raise from_proto(reply.error)
        self.cached_tokens = reply.cached_tokens
        return list(reply.hops)

    def close_session(self, session_id: str, epoch: int, timeout: float = 10.0, origin: str | None = None,
                      keep: Sequence[int] = ()) -> None:
        """Close an epoch along the route from `origin` (default: the current stage 0). `keep`: every token the
        session ran; each hop keeps what its cache holds for them in its prefix cache (docs/worker.md)."""
        blocks = block_hashes(keep) if keep else []
        try:
            self._stub(origin or self.route[0]).CloseSession(
                pb.CloseSessionRequest(session_id=session_id, epoch=epoch, chain=True, prefix_blocks=blocks,
                                       prefix_block_tokens=PREFIX_BLOCK_TOKENS if blocks else 0), timeout=timeout)
        except (grpc.RpcError, ValueError):             # ValueError: the client was closed meanwhile
            pass                                        # best effort: workers free it on their own

    def _close_failed(self, session_id: str, epoch: int, origin: str) -> None:
        """Close a failed epoch from `origin`, from a thread of its own (never wait on a dead or stopped hop), on
        a channel of its own: the origin may be the hop that failed, and the client's channel to it, dropped
        (`_drop_hop`), must not come back in gRPC's reconnect backoff."""
        ch = wtls.channel(origin, self.tls, self._opts)
        try:
            pb_grpc.StageStub(ch).CloseSession(pb.CloseSessionRequest(session_id=session_id, epoch=epoch, chain=True),
                                               timeout=self.hop_deadline)
        except grpc.RpcError:
            pass                                        # best effort: workers free it on their own
        finally:
            ch.close()

    # ------------------------------------------------------------------ recovery
    def _recover(self, err: StageError, gen: Generation, budget: int) -> None:
        """Note a failed attempt, then re-route (raise when it cannot be recovered or attempts ran out)."""
        stage = err.stage if err.stage is not None and err.stage < len(self.route) else None
        if stage is None and isinstance(err, HopUnreachable):
            stage = 0                                   # e.g. a broken stream to stage 0
        code = getattr(err, "code", "ERROR_UNSPECIFIED")
        gen.failures.append(Failure(stage, self.route[stage] if stage is not None else "", err.hop or "", code,
                                    str(err), time.monotonic(), len(gen.token_ids)))
        permanent = isinstance(err, (WrongStage, WrongRange, RemoteSchemaMismatch))
        spare = stage is not None and (len(self.replicas[stage]) > 1 or self.route_source is not None)
        if not isinstance(err, RECOVERABLE) and not (permanent and spare):
            raise err
        if len(gen.failures) >= budget:
            if isinstance(err, HopUnreachable):
                self._drop_hop(stage or 0)
            raise gave_up(err, gen.failures, gen.routes) from None
        log.warning("%s; recovering (attempt %d of %d)", err, len(gen.failures), budget)
        if isinstance(err, (HopUnreachable, Overloaded)) or permanent:
            self._replace(stage or 0, gen, retry_after=getattr(err, "retry_after_ms", 0) / 1000, drop=permanent)
        # a cache miss or lost session: the same route holds, a new epoch re-prefills it

    def _replace(self, stage: int, gen: Generation, *, retry_after: float = 0.0, drop: bool = False) -> None:
        """Move `stage` to its next replica: untried ones first, then the route source's, then the
        listed ones again in order (a worker restarted in place), after a growing pause."""
        cur = self.route[stage]
        reps = self.replicas[stage]
        if drop and len(reps) > 1:
            reps.remove(cur)                            # serves something else: never again
        tried = list(dict.fromkeys([f.address for f in gen.failures if f.stage == stage] + [cur]))
        untried = [a for a in reps if a not in tried]
        nxt = untried[0] if untried else None
        if nxt is None and self.route_source is not None:
            nxt = self.route_source(stage, tried)
            if nxt and nxt not in reps:
                reps.append(nxt)
        if not nxt:
            nxt = reps[(reps.index(cur) + 1) % len(reps)] if cur in reps else reps[0]
            again = sum(1 for f in gen.failures if f.stage == stage and f.address == nxt)
            retry_after = max(retry_after, min(2.0, 0.25 * 2 ** max(0, again - 1)))
        if retry_after:
            time.sleep(retry_after)
        if nxt != cur:
            log.warning("stage %d: %s -> %s", stage, cur, nxt)
        self.route[stage] = nxt
        if self._hops is not None:
            self._hops[stage] = None                    # described again before the next open

    def _prefer(self, route: Sequence[str] | None) -> None:
        """Use the replicas of `route` (where a prefix was left) for the stages that list them."""
        if not route or len(route) != len(self.route):
            return
        for i, a in enumerate(route):
            if a != self.route[i] and a in self.replicas[i]:
                log.debug("stage %d: %s kept this prompt's prefix: using it", i, a)
                self.route[i] = a
                if self._hops is not None:
                    self._hops[i] = None                # described before the open

    # ------------------------------------------------------------------ generation
    def generate(self, prompt: str | list[int], *, max_new_tokens: int = 32, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 0.0, seed: int = 0, logits: str = "none",
                 stop_token_ids: list[int] | None = None, attempts: int | None = None,
                 session_id: str | None = None, speculate: str | None = None,
                 draft_k: int = DEFAULT_DRAFT_K, grammar: str = "", json_schema: str = "",
                 logprobs: bool = False, top_logprobs: int = 0,
                 prefix_cache: bool | None = None) -> Iterator[TokenEvent]:
        """Yield tokens as they arrive. `logits`: none | last | all (rows go to `self.last.logits`).
        `speculate`: a draft source at the origin ("ngram"; dgr.runtime.wire.drafts) whose up to `draft_k` drafts
        per ring the last stage verifies: the same tokens, fewer rings on text that repeats its context.
        `grammar` (GBNF) or `json_schema`: the last stage draws only what the grammar allows (llama.cpp's
        grammar sampler). `logprobs` / `top_logprobs`: each event carries its token's log-probability and the
        `top_logprobs` most likely tokens' (at most MAX_TOP_LOGPROBS). `prefix_cache` (default: the client's): start from the longest
        prefix of the prompt every hop kept from earlier sessions (`self.last.cached_tokens`), and leave this
        session's tokens to the hops' caches when it ends (docs/worker.md "Prefix cache"; never with
        logits="all", which needs every row).
        Recovers from up to `attempts` (default: the client's) failed attempts, then raises."""
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise WireError("the prompt is empty")
        if grammar and json_schema:
            raise WireError("give a grammar or a json_schema, not both")
        if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise WireError(f"top_logprobs is {top_logprobs}: it must be in [0, {MAX_TOP_LOGPROBS}]")
        if speculate and (grammar or json_schema):
            raise WireError("speculative decoding with a grammar is not supported: drop speculate or the grammar")
        if speculate:
            self._check_speculation(speculate, draft_k)
        if stop_token_ids is None:
            stop_token_ids = list(self.hops[-1].eos_token_ids)
        sampling = pb.Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, grammar=grammar,
                               json_schema=json_schema, logprobs=logprobs or top_logprobs > 0,
                               top_logprobs=top_logprobs)
        _ = self.hops                                   # describe before the clock starts
        budget = attempts if attempts is not None else self.attempts
        gen = self.last = Generation(prompt_ids=ids, t_start=time.perf_counter(), chunk_tokens=self.chunk_tokens)
        sid = session_id or uuid.uuid4().hex
        epoch = 0
        use_prefix = (self.prefix_cache if prefix_cache is None else prefix_cache) and logits != "all"
        if use_prefix and self.prefix_routes is not None:
            self._prefer(self.prefix_routes.lookup(prompt_blocks(ids)))
        while len(gen.token_ids) < max_new_tokens:
            epoch += 1
            gen.epochs = epoch
            failed, origin = False, self.route[0]
            gen.routes.append(",".join(self.route))
            try:
                if grammar or json_schema:              # a re-prefill continues the structure it began
                    sampling.ClearField("grammar_accepted")
                    sampling.grammar_accepted.extend(gen.token_ids)
                history = gen.prompt_ids + gen.token_ids
                self.open(sid, epoch, sampling, LOGITS[logits],   # describes a replaced hop first
                          prompt_blocks(history) if use_prefix else ())
                cached = self.cached_tokens if use_prefix else 0
                if epoch == 1:
                    gen.cached_tokens = cached
                gen.numerics = self.numerics
                gen.exact = gen.exact and self.exact
                yield from self._run_epoch(gen, sid, epoch, max_new_tokens, stop_token_ids,
                                           pb.Generate(draft_source=speculate or "", draft_k=draft_k if speculate else 0),
                                           start=cached)
                break
            except StageError as err:
                failed = True
                self._recover(err, gen, budget)
            finally:
                if failed:
                    threading.Thread(target=self._close_failed, args=(sid, epoch, origin), daemon=True).start()
                else:
                    ran = gen.prompt_ids + gen.token_ids if use_prefix else []
                    self.close_session(sid, epoch, keep=ran)
                    if ran and self.prefix_routes is not None:
                        self.prefix_routes.remember(block_hashes(ran), self.route)

    def run(self, prompt: str | list[int], **kw) -> Generation:
        for _ in self.generate(prompt, **kw):
            pass
        return self.last

    def _check_speculation(self, source: str, k: int) -> None:
        """Refuse speculation up front where it cannot work: an unknown source, a bad k, or a hop whose
        engine cannot drop rejected drafts from its cache (recurrent/hybrid models, older workers)."""
        check_source(source)
        check_k(k)
        bad = [f"{self.hop(i)} ({d.identity.arch})" for i, d in enumerate(self.hops) if not d.can_roll_back]
        if bad:
            raise WireError(f"--speculate {source}: {', '.join(bad)} cannot roll back rejected drafts (a recurrent or "
                            "hybrid model keeps one running state, not one cache entry per position; a DeepSeek V4 "
                            "worker started with --draft-max 0; or the worker predates speculation): generate "
                            "without --speculate")
        if source == "mtp" and not self.hops[-1].has_mtp:
            last = len(self.hops) - 1
            raise WireError(f"--speculate mtp: the last stage {self.hop(last)} ({self.hops[last].identity.arch}) has no "
                            "MTP block: MTP drafts come from the last stage of a bundle built with "
                            "bundle.include_mtp = true (DeepSeek V4); use --speculate ngram or none")

    def _frames(self, gen: Generation, sid: str, epoch: int, max_new: int, stop_ids: list[int],
                spec: pb.Generate | None = None, start: int = 0):
        history = gen.prompt_ids + gen.token_ids
        g = pb.Generate(max_new_tokens=max_new - len(gen.token_ids), stop_token_ids=stop_ids,
                        context_ids=gen.token_ids, context_text=gen.text)
        if spec is not None:
            g.draft_source, g.draft_k = spec.draft_source, spec.draft_k
            if spec.draft_source and start:             # restored positions no step carries: drafts look there too
                g.cached_ids.extend(history[:start])
        yield pb.Frame(session_id=sid, epoch=epoch, generate=g)
        starts = list(range(start, len(history), self.chunk_tokens))   # start: what every hop restored
        if gen.token_ids and not all(h.batch_invariant for h in self.hops):
            # a hop whose results depend on the batch (docs/batching.md): replay the history the way it
            # was first computed, the prompt in the same chunks and each generated token as its own step
            n = len(gen.prompt_ids)
            starts = [*range(0, n, self.chunk_tokens), *range(n, len(history))]
        for lo, hi in zip(starts, [*starts[1:], len(history)]):
            f = pb.Frame(session_id=sid, epoch=epoch, step=pb.Step(
                positions=range(lo, hi), token_ids=history[lo:hi], cache_expect=lo,
                sample=hi == len(history)))
            size = f.ByteSize()
            if size > self.max_message_bytes:
                raise WireError(f"a {size}-byte prompt chunk exceeds the message limit; lower chunk_tokens")
            self.max_frame_bytes_sent = max(self.max_frame_bytes_sent, size)
            yield f

    def _run_epoch(self, gen: Generation, sid: str, epoch: int, max_new: int, stop_ids: list[int],
                   spec: pb.Generate | None = None, start: int = 0):
        q: queue.Queue = queue.Queue()
        outgoing: queue.Queue = queue.Queue()
        for f in self._frames(gen, sid, epoch, max_new, stop_ids, spec, start):
            outgoing.put(f)
        if epoch == 1:
            gen.t_start = time.perf_counter()           # prefill time starts with the first chunk sent
        # No fixed deadline on the stream (it lasts the generation): `_watch` bounds every wait on it.
        call = self._stub(self.route[0]).Frames(iter(outgoing.get, _END))

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
                item = self._watch(lambda t: q.get(timeout=t), "no reply from the route")
                if item is _END:
                    raise self.probe() or HopUnreachable(
                        "stage 0 closed the stream before the generation finished", hop=self.hop(0))
                if isinstance(item, grpc.RpcError):
                    raise unreachable(self.hop(0), "the stream broke (that worker may have died)", item, tls=self.tls is not None) from None
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
                                 for h in t.timings], t.return_ns, speculated=t.speculated,
                                drafted=t.drafted, accepted=len(t.accepted), at=now)
                if t.logprobs:
                    ev.logprob = t.logprobs[0].logprob
                    ev.top_logprobs = [(e.token_id, e.logprob) for e in t.logprobs[0].top]
                gen.token_ids.append(t.token_id)
                gen.text += t.text
                gen.events.append(ev)
                yield ev
                if t.done:
                    return
        finally:
            outgoing.put(_END)
            call.cancel()
