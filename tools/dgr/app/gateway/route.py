"""The gateway's side of a route: what the model is (from Describe), a pool of route clients, and one
generation per request run in its own thread, its text delivered to the event loop.

`RouteClient.generate` is a blocking iterator, so every request's generation runs in a thread of its
own (concurrent requests are concurrent sessions along the route) and hands its pieces to the
request's asyncio queue. A request for n choices is a `Run` of n jobs, each its own generation and
session, their pieces merged on one queue. Cancelling a job (the HTTP client went away, or
`POST /v1/responses/{id}/cancel`) stops the iteration at the next token and closes the generator, whose
`finally` closes the session along the route (chain=True) before the job says it has finished.

A job asked for logprobs hands each piece of text over with the tokens whose text it begins (`Tok`: the
token's own text, its logprob and the most likely tokens'); a token whose text a stop string swallowed
whole, and a token-level stop, are not reported.
"""

from __future__ import annotations

import asyncio
import copy
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from dgr.app.gateway.metrics import GatewayMetrics
from dgr.app.gateway.stops import StopScanner
from dgr.core.errors import WireError
from dgr.core.hashing import bytes_blake3
from dgr.core.log import get_logger
from dgr.runtime.wire import tls as wtls
from dgr.runtime.wire.client import PrefixRoutes, RouteClient, parse_route

log = get_logger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    """What the route serves, read once from its workers' Describe."""

    name: str                    # the model id clients ask for (--model-name, or hops[0].identity.model)
    bundle_id: str
    n_ctx: int                   # positions a session may hold: the smallest of every stage's
    # token-level stops: the last stage's eos_token_ids, every id that ends a generation as llama.cpp sees
    # it (eos, eot, eom, <|im_end|>, ...); the first is the eos (an older worker sends the eos alone)
    eos_ids: tuple[int, ...]
    chat_template: str           # the Jinja chat template ("" when there is none)
    chat_template_source: str    # where it came from: "--chat-template FILE", "the GGUF (...)", or "none"
    bos_token: str
    eos_token: str
    stages: int
    created: int                 # when the gateway first described the route (the model's `created`)
    # speculative decoding the route can do, each source -> why not ("" when it can): "ngram" needs every hop
    # to roll back rejected drafts, "mtp" also an MTP block on the last stage (docs/speculation.md)
    speculation: tuple[tuple[str, str], ...] = ()
    # each stage's numerics (docs/numerics.md) when the gateway first described the route. A route that mixes
    # them is refused unless `dgr serve --allow-mixed-numerics`; with that, `exact` is False (a recovery may move
    # any stage onto other numerics) and every response says so.
    numerics: tuple[str, ...] = ()
    exact: bool = True

    @property
    def fingerprint(self) -> str:
        """OpenAI's system_fingerprint: the backend configuration that decides the results, the bundle and the
        numerics every stage computes with (docs/numerics.md), or "mixed" where the operator allowed a mix."""
        numerics = bytes_blake3("\n".join(self.numerics).encode())[:8]
        return f"dgr-{self.bundle_id[:12]}-{numerics if self.exact else 'mixed'}"

    def cannot_speculate(self, source: str) -> str:
        """Why this route cannot draft with `source` ("" when it can)."""
        return dict(self.speculation).get(source, f"unknown draft source {source!r}: choose none, ngram or mtp")

    def draft_source(self, asked: str | None, structured: bool, default: str | None) -> str | None:
        """A request's draft source: its own `speculate` ("none": off), else the server's `default`, which steps
        aside for a grammar (`structured`: a JSON schema or tools). ValueError says why the request's own
        choice cannot run."""
        if asked is None:
            return None if structured else default
        if asked == "none":
            return None
        if structured:
            raise ValueError(f"speculate={asked!r} with a JSON schema or tools is not supported (speculative "
                             "decoding with a grammar): drop one of them")
        why = self.cannot_speculate(asked)
        if why:
            raise ValueError(f"speculate={asked!r}: {why}")
        return asked


def _first_line(text: str, width: int = 80) -> str:
    line = next((x.strip() for x in text.splitlines() if x.strip()), "")
    return repr(line if len(line) <= width else line[:width - 3] + "...")


@dataclass(frozen=True)
class Params:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stops: tuple[str, ...] = ()
    ignore_eos: bool = False
    json_schema: str = ""        # the last stage draws only what this JSON Schema allows ("" : anything)
    logprobs: bool = False
    top_logprobs: int = 0
    speculate: str | None = None  # a draft source ("ngram", "mtp") whose drafts each ring verifies; None: none
    draft_k: int = 4
    prefix_cache: bool = True     # restore and keep the prompt's prefix in the stages' caches (`cache_prompt`)


@dataclass(frozen=True)
class Tok:
    """A generated token as the gateway reports it (dgr.app.gateway.schemas formats it)."""

    id: int
    text: str                                # its own text: the id detokenized alone
    logprob: float
    top: tuple[tuple[str, float], ...]       # (text, logprob) of the most likely tokens, most likely first
    offset: int                              # where its text starts in the choice's printed text


@dataclass(frozen=True)
class Piece:
    """Text a job printed, and (logprobs asked) the tokens whose text starts in it."""

    text: str
    toks: tuple[Tok, ...] = ()


class RouteBackend:
    """The route (text or replicas per stage) and a pool of `RouteClient`s over it: each request takes a
    client of its own (its recovery state is its own) and gives it back when done; channels are reused.
    The pool shares one `PrefixRoutes`, so a request whose prompt begins with an earlier one's opens on the
    replicas that kept that prefix (`usage.prompt_tokens_details.cached_tokens` says how much was restored)."""

    def __init__(self, route: str | Sequence[Sequence[str]], *, tls: wtls.TlsConfig | None = None,
                 timeout: float = 120.0, hop_deadline: float | None = None, attempts: int | None = None,
                 model_name: str | None = None, chat_template: str | None = None,
                 chat_template_source: str | None = None, allow_mixed_numerics: bool = False):
        self.replicas = parse_route(route) if isinstance(route, str) else [list(r) for r in route]
        self._kw = {"tls": tls, "timeout": timeout, "allow_mixed_numerics": allow_mixed_numerics}
        if hop_deadline is not None:
            self._kw["hop_deadline"] = hop_deadline
        if attempts is not None:
            self._kw["attempts"] = attempts
        self._idle: list[RouteClient] = []
        self._lock = threading.Lock()
        self._texts: dict[int, str] = {}     # token id -> its own text (the vocabulary does not change)
        # shared by the pool: a conversation's next turn opens on the replicas that kept its history
        self.prefix_routes = PrefixRoutes()
        self.info = self._describe(model_name, chat_template, chat_template_source)

    def _new_client(self) -> RouteClient:
        return RouteClient(copy.deepcopy(self.replicas), prefix_routes=self.prefix_routes, **self._kw)

    @contextmanager
    def client(self) -> Iterator[RouteClient]:
        with self._lock:
            c = self._idle.pop() if self._idle else None
        c = c or self._new_client()
        try:
            yield c
        finally:
            with self._lock:
                self._idle.append(c)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()

    def _describe(self, model_name: str | None, chat_template: str | None,
                  chat_template_source: str | None) -> ModelInfo:
        """`chat_template`: a template to use instead of the model's own (`chat_template_source` says
        where it came from, e.g. "--chat-template FILE"); None: the GGUF's tokenizer.chat_template as
        the first stage that has the vocabulary describes it."""
        with self.client() as c:
            # at start, a worker still loading (`dgr serve` right after `dgr up`) is waited for within --timeout
            c.describe(missing_only=True, wait=self._kw["timeout"])
            hops = c.hops
            for line in c.check_replicas():             # every replica computes the route's numerics (or says so)
                log.warning("gateway: %s", line)
            ident = hops[0].identity
            eos_ids = tuple(hops[-1].eos_token_ids)
            if chat_template is not None:
                template, source = chat_template, chat_template_source or "given to the gateway"
            else:
                own = next(((i, h.chat_template) for i, h in enumerate(hops) if h.chat_template), None)
                template = own[1] if own else ""
                source = f"the GGUF's tokenizer.chat_template (stage {own[0]})" if own else "none"
            eos_token = c.detokenize([eos_ids[0]]) if eos_ids else ""
            bos = [t for t in c.tokenize("", add_special=True)]
            bos_token = c.detokenize(bos[:1]) if bos else ""
        n_ctx = min(h.n_ctx for h in hops)
        stiff = [f"stage {i} ({h.identity.arch})" for i, h in enumerate(hops) if not h.can_roll_back]
        roll = f"{', '.join(stiff)} cannot roll back rejected drafts" if stiff else ""
        mtp = roll or ("" if hops[-1].has_mtp else "the last stage has no MTP block (a bundle built with "
                       "bundle.include_mtp = true has one)")
        info = ModelInfo(name=model_name or ident.model or ident.bundle_id, bundle_id=ident.bundle_id, n_ctx=n_ctx,
                         eos_ids=eos_ids, chat_template=template, chat_template_source=source, bos_token=bos_token,
                         eos_token=eos_token, stages=len(hops), created=int(time.time()),
                         speculation=(("ngram", roll), ("mtp", mtp)),
                         numerics=tuple(h.identity.numerics for h in hops),
                         # an operator who allows a mix may get one on any recovery: then nothing is called exact
                         exact=not self._kw["allow_mixed_numerics"] and len({h.identity.numerics for h in hops}) == 1)
        log.info("gateway: route of %d stage(s) serves %s (bundle %s, n_ctx %d); stops at token ids %s",
                 info.stages, info.name, info.bundle_id[:16], n_ctx, list(eos_ids) or "(none: only max_tokens)")
        if not info.exact:
            log.warning("gateway: mixed numerics allowed (now: %s): results may match no whole-model run, and every "
                        "response says so (header X-Dgr-Exact: false, system_fingerprint dgr-...-mixed)",
                        "; ".join(f"stage {i}: {n}" for i, n in enumerate(info.numerics)))
        if template:
            log.info("gateway: chat template from %s (first line: %s)", source, _first_line(template))
        else:
            log.info("gateway: no chat template (the model has no tokenizer.chat_template): /v1/chat/completions "
                     "answers 400 chat_template_missing; start `dgr serve` with --chat-template FILE to serve chat")
        return info

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        with self.client() as c:
            return c.tokenize(text, add_special=add_special)

    def token_texts(self, c: RouteClient, ids) -> list[str]:
        """Each id's own text (detokenized alone, one Detokenize each the first time, then remembered).
        A token that is part of a multi-byte character reads as U+FFFD."""
        missing = [i for i in dict.fromkeys(ids) if i not in self._texts]
        for i in missing:
            self._texts[i] = c.detokenize([i])
        return [self._texts[i] for i in ids]

    def detokenize(self, ids: list[int]) -> str:
        with self.client() as c:
            return c.detokenize(ids)

    def open_sessions(self) -> list[int]:
        """Every stage's open sessions now (Describe of the current replicas)."""
        with self.client() as c:
            return [d.open_sessions for d in c.describe()]


SEED_SPACE = 2 ** 64                     # the wire's Sampling.seed is a uint64


def choice_seeds(seed: int | None, n: int, sampled: bool) -> list[int]:
    """The seed of each of n choices: `seed`+i (so a request with a seed is reproducible, and its choice 0
    is what n=1 gives), from a random base when none is given and the request samples; greedy: 0."""
    if seed is None:
        seed = secrets.randbits(63) if sampled else 0
    return [(seed + i) % SEED_SPACE for i in range(n)]


class Job:
    """One generation, run in its own thread. It puts (index, "text", Piece) on `queue`, then one
    (index, "done", finish_reason) or (index, "error", exception). `completion_tokens` counts tokens
    sampled; `text` is what it printed so far, `toks` the tokens reported so far (logprobs asked);
    `cached_tokens`, once it has started, the prompt positions the stages restored from their prefix caches."""

    def __init__(self, backend: RouteBackend, prompt_ids: list[int], params: Params, metrics: GatewayMetrics,
                 t_request: float, queue: asyncio.Queue, index: int = 0):
        self.backend, self.prompt_ids, self.params, self.metrics = backend, prompt_ids, params, metrics
        self.t_request, self.index = t_request, index
        self.completion_tokens = 0
        self.t_first = 0.0
        self.pieces: list[str] = []
        self.toks: list[Tok] = []
        self.cached_tokens = 0
        self.finish: str | None = None          # "stop" or "length" once done
        self.why = ""                           # why it was cancelled: "client_gone" or "cancelled"
        self.cut_short = False                  # a cancel stopped the generation (not its own end)
        self._cancel = threading.Event()
        self.finished = threading.Event()       # the generation thread is done (its session closed)
        self._loop = asyncio.get_running_loop()
        self._queue = queue
        self._thread = threading.Thread(target=self._run, daemon=True, name="gateway-generation")
        self._thread.start()

    def cancel(self, why: str = "client_gone") -> None:
        if not self._cancel.is_set():
            self.why = why
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def cancelled_by_request(self) -> bool:
        """`POST /v1/responses/{id}/cancel` stopped it before it ended on its own."""
        return self.cut_short and self.why == "cancelled"

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def _put(self, what: str, payload) -> None:
        if what == "text":
            self.pieces.append(payload.text)
            self.toks.extend(payload.toks)
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (self.index, what, payload))
        except RuntimeError:                            # the event loop is gone (shutting down)
            self._cancel.set()

    def _stopped(self) -> None:
        self.cut_short = True
        m = self.metrics
        (m.cancelled if self.why == "cancelled" else m.client_gone).inc()

    def _run(self) -> None:
        p, m = self.params, self.metrics
        eos = set(self.backend.info.eos_ids)
        stop_ids = [] if p.ignore_eos else sorted(eos)
        scanner = StopScanner(list(p.stops))
        seed = choice_seeds(p.seed, 1, p.temperature > 0)[0]
        temperature = 0.0 if p.top_p == 0 else p.temperature       # top_p 0: only the most likely token
        top_p = p.top_p if 0 < p.top_p < 1 else 0.0                 # dgr: 0 is off
        finish = "length"
        want_lp = p.logprobs or p.top_logprobs > 0
        fed = printed = 0                   # characters given to the stop scanner / printed
        pending: list[Tok] = []             # reported tokens whose text is not printed yet

        def release(text: str, everything: bool = False) -> None:
            nonlocal printed, pending
            printed += len(text)
            k = len(pending) if everything else next((j for j, t in enumerate(pending) if t.offset >= printed),
                                                      len(pending))
            out, pending = pending[:k], pending[k:]
            if text or out:
                self._put("text", Piece(text, tuple(out)))

        m.active.inc()
        m.prompt_tokens.inc(len(self.prompt_ids))
        try:
            if self._cancel.is_set():                       # cancelled before it started
                raise _Gone()
            with self.backend.client() as c:
                it = c.generate(self.prompt_ids, max_new_tokens=p.max_tokens, temperature=temperature,
                                top_k=p.top_k, top_p=top_p, seed=seed, stop_token_ids=stop_ids,
                                json_schema=p.json_schema, logprobs=p.logprobs, top_logprobs=p.top_logprobs,
                                speculate=p.speculate, draft_k=p.draft_k, prefix_cache=p.prefix_cache)
                last = 0.0
                try:
                    for ev in it:
                        now = time.perf_counter()
                        if not self.completion_tokens:
                            self.t_first = now
                            self.cached_tokens = c.last.cached_tokens
                            m.ttft.observe(now - self.t_request)
                        else:
                            m.token_latency.observe(now - last)
                        last = now
                        self.completion_tokens += 1
                        m.generated_tokens.inc()
                        if ev.token_id in stop_ids:         # a token-level stop: its text is never printed
                            finish = "stop"
                            break
                        if want_lp:
                            own = self.backend.token_texts(c, [ev.token_id, *(t for t, _ in ev.top_logprobs)])
                            pending.append(Tok(ev.token_id, own[0], ev.logprob,
                                               tuple(zip(own[1:], (lp for _, lp in ev.top_logprobs))), fed))
                        fed += len(ev.text)
                        release(scanner.feed(ev.text))
                        if scanner.stopped:
                            finish = "stop"
                            break
                        if self._cancel.is_set():
                            log.info("gateway: %s after %d token(s); closing its session along the route",
                                     "cancelled" if self.why == "cancelled" else "client gone",
                                     self.completion_tokens)
                            self._stopped()
                            break
                finally:
                    it.close()                              # closes the session along the route
            release(scanner.flush(), everything=not scanner.stopped and not self.cut_short)
            self.finish = finish
            self._put("done", finish)
        except _Gone:
            self._stopped()
            self.finish = finish
            self._put("done", finish)
        except WireError as err:
            self._put("error", err)
        except Exception as err:                            # never leave a request waiting
            log.exception("gateway: generation failed")
            self._put("error", err)
        finally:
            m.active.dec()
            self.finished.set()


class Run:
    """One request's generations: a job per choice (`params[i]` for choice i), each its own session along
    the route, started together. `events()` merges their pieces in arrival order as (index, kind,
    payload), ending once every job has sent its last (done or error)."""

    def __init__(self, backend: RouteBackend, prompt_ids: list[int], params: Sequence[Params],
                 metrics: GatewayMetrics, t_request: float):
        self._queue: asyncio.Queue = asyncio.Queue()
        self.jobs = [Job(backend, prompt_ids, p, metrics, t_request, self._queue, i) for i, p in enumerate(params)]
        self.watch: asyncio.Task | None = None  # the app's check for a client that went away

    def cancel(self, why: str = "client_gone") -> None:
        for j in self.jobs:
            j.cancel(why)

    @property
    def cancelled(self) -> bool:
        return any(j.cancelled for j in self.jobs)

    @property
    def finished(self) -> bool:
        return all(j.finished.is_set() for j in self.jobs)

    def wait(self, timeout: float) -> bool:
        """Block until every job has finished (its session closed along the route), at most `timeout` s."""
        deadline = time.monotonic() + timeout
        return all(j.finished.wait(max(0.0, deadline - time.monotonic())) for j in self.jobs)

    @property
    def completion_tokens(self) -> int:
        return sum(j.completion_tokens for j in self.jobs)

    async def events(self):
        left = len(self.jobs)
        while left:
            item = await self._queue.get()
            yield item
            if item[1] != "text":
                left -= 1


class _Gone(Exception):
    """The job was cancelled before its generation started."""
