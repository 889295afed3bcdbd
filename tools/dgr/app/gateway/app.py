"""The OpenAI-compatible HTTP app over one route (FastAPI): models, completions, chat completions, the
Responses API (text), metrics.

Every error answers OpenAI's shape (dgr.app.gateway.errors: GatewayError and the handlers): 400 for a bad
request (bad JSON, bad field, over-long prompt, n_ctx exceeded, a chat template that refuses the
messages), 404 for an unknown model or URL, 502/503 for a route that fails (the typed WireError's
message; an unreachable hop: 503 `hop_unreachable` + Retry-After, its gRPC details only in the log). A
failure after a stream started arrives as one `data: {"error": ...}` event (on a Responses stream: an
`error` event, then response.failed).

A client that goes away (closes, times out, resets) stops its generation, streaming or not: every
request's connection is checked every DISCONNECT_POLL_S on a timer of its own, whatever the tokens do,
and a gone client's job is cancelled, which closes its session along the route (docs/gateway.md).
`POST /v1/responses/{id}/cancel` does the same for a streamed response that is still running, and answers
once every stage has let go.

A request for `n` choices runs n generations at once, each its own session along the route, with seeds
`seed`+i (dgr.app.gateway.route.choice_seeds).

`response_format`, `tools`/`tool_choice` (chat) and `text.format` (Responses) constrain the output with a
JSON Schema the last stage's grammar sampler enforces, and tool calls are parsed back (dgr.app.gateway.structured);
`logprobs`/`top_logprobs` report each token's log-probability; `usage` says how many prompt tokens the stages
restored from their prefix caches (`cached_tokens`).
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from dgr import __version__
from dgr.app.gateway import chat, errors, inputs, structured
from dgr.app.gateway.errors import GatewayError, route_error, schema_error
from dgr.app.gateway.limits import CANCEL_WAIT_S, DEFAULT_CHAT_MAX_TOKENS, DEFAULT_COMPLETION_TOKENS, DISCONNECT_POLL_S
from dgr.app.gateway.metrics import GatewayMetrics, MetricsMiddleware
from dgr.app.gateway.schemas import completions as schemas
from dgr.app.gateway.schemas.responses import InputRefused, ResponseShape, ResponsesRequest, sse, status_of
from dgr.app.gateway.route import Params, RouteBackend, Run, choice_seeds
from dgr.app.gateway.routes import models, ops
from dgr.app.gateway.schemas.completions import Answer
from dgr.app.gateway.state import GatewayState
from dgr.core.log import get_logger
from dgr.runtime.wire.drafts import DEFAULT_DRAFT_K

log = get_logger(__name__)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _cancel_when_gone(request: Request, run: Run) -> None:
    """Cancel `run` once its client has gone: checked on a timer, not when a token arrives, so a fast
    route never hides the disconnect and a slow one never delays seeing it."""
    while not run.finished:
        await asyncio.sleep(DISCONNECT_POLL_S)
        if run.finished:
            return
        if await request.is_disconnected():
            if not run.cancelled:
                log.info("gateway: the client of %s went away after %d token(s); stopping its generation",
                         request.url.path, run.completion_tokens)
            run.cancel()
            return


def create_app(backend: RouteBackend, metrics: GatewayMetrics | None = None, *,
               max_tokens_default: int = DEFAULT_CHAT_MAX_TOKENS, speculate: str | None = None,
               draft_k: int = DEFAULT_DRAFT_K) -> FastAPI:
    """The gateway over `backend`. `max_tokens_default`, `speculate`, `draft_k`: the server's defaults
    (dgr.app.gateway.state.GatewayState)."""
    st = GatewayState.of(backend, metrics, max_tokens_default=max_tokens_default, speculate=speculate,
                         draft_k=draft_k)
    info, m, speculate, draft_k = st.info, st.metrics, st.speculate, st.draft_k
    fingerprint = info.fingerprint
    app = FastAPI(title="dgr gateway", version=__version__, docs_url=None, redoc_url=None)
    app.state.gateway = st
    app.add_middleware(MetricsMiddleware, metrics=m, exact=info.exact)

    errors.install(app, m)
    app.include_router(models.router)
    app.include_router(ops.router)

    # ------------------------------------------------------------------ generation
    async def _parse(request: Request, cls):
        return await inputs.parse(request, cls, info)

    def _budget(*args, **kw) -> int:
        return inputs.budget(info, *args, **kw)

    def _completion_ids(req: schemas.CompletionRequest) -> list[int]:
        return inputs.completion_ids(backend, req)

    def _chat_ids(*args, **kw) -> list[int]:
        return inputs.chat_ids(backend, *args, **kw)

    def _start(request: Request, req, ids: list[int], max_tokens: int, t0: float, n: int = 1, *,
               json_schema: str = "", top_logprobs: int | None = None) -> Run:
        """n generations of `ids` (one per choice, seeds `seed`+i), watched for a client that goes away.
        `top_logprobs`: None, no logprobs; n >= 0, each token's and the n most likely tokens'."""
        seeds = choice_seeds(req.seed, n, req.temperature > 0 and req.top_p > 0)
        stops = tuple(getattr(req, "stops", ()))
        try:
            source = info.draft_source(getattr(req, "speculate", None), bool(json_schema), speculate)
        except ValueError as err:
            raise GatewayError(400, str(err), param="speculate", code="unsupported_parameter") from None
        k = getattr(req, "draft_k", None) or draft_k
        params = [Params(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                         seed=seed, stops=stops, ignore_eos=req.ignore_eos, json_schema=json_schema,
                         logprobs=top_logprobs is not None, top_logprobs=top_logprobs or 0, speculate=source,
                         draft_k=k, prefix_cache=getattr(req, "cache_prompt", True)) for seed in seeds]
        run = Run(backend, ids, params, m, t0)
        # runs until the generations end, whoever serves the response (this coroutine or the stream)
        run.watch = asyncio.create_task(_cancel_when_gone(request, run))
        return run

    def _answer(job, finish, plan: structured.Plan | None, logprobs: bool) -> Answer:
        """A finished choice: its text, or the tool call its text is (tools in play)."""
        toks = list(job.toks) if logprobs else None
        if plan is not None and plan.mode != "none":
            call = structured.parse_call(job.text, plan.names)
            if call is not None:
                return Answer(None, "tool_calls", toks, [call])
        return Answer(job.text, finish, toks)

    async def _generate(request: Request, shapes: schemas.Shapes, req, ids: list[int], max_tokens: int, t0: float,
                        *, plan: structured.Plan | None = None, top_logprobs: int | None = None):
        run = _start(request, req, ids, max_tokens, t0, req.n, json_schema=plan.json_schema if plan else "",
                     top_logprobs=top_logprobs)
        # Wait for the first piece before answering: a route that fails at once gets its HTTP status.
        events = run.events()
        finishes: list = [None] * req.n
        streaming = False
        try:
            async for index, what, payload in events:
                if what == "error":
                    raise (schema_error(payload, plan.param) if plan else None) or route_error(payload)
                if run.cancelled:
                    return Response(status_code=499)    # nobody reads it: the client has gone
                if req.stream:
                    streaming = True
                    return StreamingResponse(_stream(run, shapes, req, len(ids), (index, what, payload), events,
                                                     plan, top_logprobs is not None),
                                             media_type="text/event-stream",
                                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
                if what == "done":
                    finishes[index] = payload
            answers = [_answer(j, f, plan, top_logprobs is not None) for j, f in zip(run.jobs, finishes)]
            return shapes.full(answers, len(ids), run.completion_tokens, run.jobs[0].cached_tokens)
        finally:
            if not streaming:
                run.cancel()

    async def _stream(run: Run, shapes: schemas.Shapes, req, n_prompt: int, first, events,
                      plan: structured.Plan | None, logprobs: bool):
        m.open_streams.inc()
        holds = [structured.CallHold(plan) if plan is not None else None for _ in run.jobs]
        try:
            if shapes.kind == "chat":
                role = "call" if plan is not None and plan.mode in ("required", "named") else True
                for i in range(len(run.jobs)):
                    yield _sse(shapes.chunk(None, role=role, index=i))
            item, failed = first, False
            while item is not None:
                index, what, payload = item
                if what == "text":
                    hold = holds[index]
                    out = hold.feed(payload.text, list(payload.toks)) if hold else (payload.text, list(payload.toks))
                    if out is not None:
                        yield _sse(shapes.chunk(out[0], index=index, toks=out[1] if logprobs else None))
                elif what == "error":
                    err = route_error(payload)
                    m.error(err.code or err.type)
                    yield _sse(err.body())
                    failed = True
                    break
                elif what == "done":
                    finish = payload
                    if holds[index] is not None:
                        call, text, toks = holds[index].end()
                        if call is not None:
                            finish = "tool_calls"
                            yield _sse(shapes.chunk(None, index=index, tool_calls=[call],
                                                    toks=toks if logprobs else None))
                        elif text or toks:
                            yield _sse(shapes.chunk(text, index=index, toks=toks if logprobs else None))
                    yield _sse(shapes.chunk(None, finish, index=index))
                item = await anext(events, None)
            if not failed and req.include_usage:
                yield _sse(shapes.usage_chunk(n_prompt, run.completion_tokens, run.jobs[0].cached_tokens))
            yield "data: [DONE]\n\n"
        finally:
            run.cancel()                        # a client that went away: its sessions close along the route
            m.open_streams.dec()
            await events.aclose()

    @app.post("/v1/completions")
    async def completions(request: Request):
        t0 = time.perf_counter()
        req = await _parse(request, schemas.CompletionRequest)
        ids = await run_in_threadpool(_completion_ids, req)
        base = 0
        if req.logprobs is not None:            # text_offset counts from the start of the prompt, as OpenAI's
            p = req.prompt[0] if isinstance(req.prompt, list) and len(req.prompt) == 1 else req.prompt
            base = len(p) if isinstance(p, str) else len(await run_in_threadpool(backend.detokenize, ids))
        shapes = schemas.Shapes("completion", info.name, fingerprint, text_base=base)
        return await _generate(request, shapes, req, ids,
                               _budget(req.max_tokens, len(ids), "prompt", DEFAULT_COMPLETION_TOKENS), t0,
                               top_logprobs=req.logprobs)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        t0 = time.perf_counter()
        req = await _parse(request, schemas.ChatRequest)
        plan = structured.plan(req)
        try:
            messages = [msg.for_template() for msg in req.messages]
        except ValueError as err:
            raise GatewayError(400, str(err), param="messages", code="invalid_messages") from None
        native = bool(info.chat_template) and chat.uses_tools(info.chat_template)
        messages = structured.for_template(messages, native=native)
        tools = None
        if plan.tools:
            if native:
                tools = [t.model_dump(exclude_none=True) for t in plan.tools]
            else:
                messages = structured.with_tools_text(messages, structured.tools_text(plan.tools, plan.mode))
        ids = await run_in_threadpool(_chat_ids, messages, "messages", req.add_generation_prompt, tools)
        shapes = schemas.Shapes("chat", info.name, fingerprint)
        return await _generate(request, shapes, req, ids,
                               _budget(req.max_tokens, len(ids), "messages", max_tokens_default or None), t0,
                               plan=plan, top_logprobs=(req.top_logprobs or 0) if req.logprobs else None)

    # ------------------------------------------------------------------ the Responses API
    live = st.live                  # streamed responses still running, by id

    @app.post("/v1/responses")
    async def responses(request: Request):
        t0 = time.perf_counter()
        req = await _parse(request, ResponsesRequest)
        try:
            messages = req.messages()
        except InputRefused as err:
            raise GatewayError(400, str(err), param=err.param, code="invalid_value") from None
        ids = await run_in_threadpool(_chat_ids, messages, "input")
        budget = _budget(req.max_output_tokens, len(ids), "input", max_tokens_default or None, "max_output_tokens")
        schema = req.json_schema
        run = _start(request, req, ids, budget, t0, json_schema=json.dumps(schema) if schema is not None else "",
                     top_logprobs=(req.top_logprobs or 0) if req.logprobs else None)
        shape = ResponseShape(info.name, req)
        events = run.events()
        finish = None
        streaming = False
        try:
            async for _, what, payload in events:
                if what == "error":
                    raise (schema_error(payload, "text.format") if schema is not None else None) or route_error(payload)
                if run.cancelled:
                    return Response(status_code=499)    # nobody reads it: the client has gone
                if req.stream:
                    streaming = True
                    return StreamingResponse(_stream_response(run, shape, (what, payload), events),
                                             media_type="text/event-stream",
                                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
                if what == "done":
                    finish = payload
            job = run.jobs[0]
            return shape.body(status_of(finish, False), job.text, finish, _tokens(job), toks=job.toks)
        finally:
            if not streaming:
                run.cancel()

    def _tokens(job) -> tuple[int, int, int]:
        """(input, output, cached input) tokens of a response's generation, for its usage."""
        return len(job.prompt_ids), job.completion_tokens, job.cached_tokens

    async def _stream_response(run: Run, shape: ResponseShape, first, events):
        job = run.jobs[0]
        live[shape.id] = (run, shape)
        m.open_streams.inc()
        try:
            for ev in shape.opening():
                yield sse(ev)
            item = first
            while item is not None:
                what, payload = item
                if what == "text":
                    yield sse(shape.delta(payload.text, payload.toks))
                elif what == "error":
                    err = route_error(payload)
                    m.error(err.code or err.type)
                    for ev in shape.failure(err.body()["error"], job.text, _tokens(job)):
                        yield sse(ev)
                    return
                elif what == "done":
                    status = status_of(payload, job.cancelled_by_request)
                    for ev in shape.closing(job.text, status, payload, _tokens(job), job.toks):
                        yield sse(ev)
                    return
                nxt = await anext(events, None)
                item = nxt[1:] if nxt else None
        finally:
            live.pop(shape.id, None)
            run.cancel()                        # a client that went away: its session closes along the route
            m.open_streams.dec()
            await events.aclose()

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str):
        """Stop a streamed response that is still running: its generation stops at the next token and its
        session closes on every stage before this answers (the response, `status: cancelled`)."""
        found = live.get(response_id)
        if found is None:
            raise GatewayError(404, f"No response with id '{response_id}' is in progress here: only a streamed "
                                    "response that is still running can be cancelled (responses are not stored)",
                               param="response_id", code="response_not_found")
        run, shape = found
        run.cancel("cancelled")
        if not await asyncio.to_thread(run.wait, CANCEL_WAIT_S):
            raise GatewayError(504, f"response '{response_id}' was cancelled but its generation did not stop "
                                    f"within {CANCEL_WAIT_S:g} s", "server_error", code="cancel_timeout")
        job = run.jobs[0]
        # a response that ended on its own before the cancel landed says how it ended
        return shape.body(status_of(job.finish, job.cancelled_by_request), job.text, job.finish, _tokens(job),
                          toks=job.toks)

    return app
