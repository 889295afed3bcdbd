"""`POST /v1/completions` and `POST /v1/chat/completions`: a prompt (or chat messages, rendered by the
model's chat template) completed along the route, whole or streamed as `data: {chunk}` events ending with
`data: [DONE]` (a failure mid-stream: one `data: {"error": ...}` event, then `data: [DONE]`).

A request for `n` choices runs n generations at once, each its own session along the route.
`response_format` and `tools`/`tool_choice` (chat) constrain the output with a JSON Schema the last stage's
grammar sampler enforces, and a tool call is parsed back out of the text (dgr.app.gateway.structured);
`logprobs`/`top_logprobs` report each token's log-probability; `usage` says how many prompt tokens the stages
restored from their prefix caches (`cached_tokens`).
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from dgr.app.gateway import chat, generation, inputs, structured
from dgr.app.gateway.errors import GatewayError, schema_error
from dgr.app.gateway.limits import DEFAULT_COMPLETION_TOKENS
from dgr.app.gateway.route import Piece, Run
from dgr.app.gateway.schemas.completions import Answer, ChatRequest, CompletionRequest, Shapes
from dgr.app.gateway.state import GatewayState, StateDep
from dgr.app.gateway.streaming import data_event

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request, st: StateDep):
    t0 = time.perf_counter()
    req = await inputs.parse(request, CompletionRequest, st.info)
    ids = await run_in_threadpool(inputs.completion_ids, st.backend, req)
    base = 0
    if req.logprobs is not None:            # text_offset counts from the start of the prompt, as OpenAI's
        p = req.prompt[0] if isinstance(req.prompt, list) and len(req.prompt) == 1 else req.prompt
        base = len(p) if isinstance(p, str) else len(await run_in_threadpool(st.backend.detokenize, ids))
    shapes = Shapes("completion", st.info.name, st.info.fingerprint, text_base=base)
    return await _generate(st, request, shapes, req, ids,
                           inputs.budget(st.info, req.max_tokens, len(ids), "prompt", DEFAULT_COMPLETION_TOKENS), t0,
                           top_logprobs=req.logprobs)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, st: StateDep):
    t0 = time.perf_counter()
    info = st.info
    req = await inputs.parse(request, ChatRequest, info)
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
    ids = await run_in_threadpool(inputs.chat_ids, st.backend, messages, "messages", req.add_generation_prompt, tools)
    shapes = Shapes("chat", info.name, info.fingerprint)
    return await _generate(st, request, shapes, req, ids,
                           inputs.budget(info, req.max_tokens, len(ids), "messages", st.max_tokens_default or None),
                           t0, plan=plan, top_logprobs=(req.top_logprobs or 0) if req.logprobs else None)


async def _generate(st: GatewayState, request: Request, shapes: Shapes, req, ids: list[int], max_tokens: int,
                    t0: float, *, plan: structured.Plan | None = None, top_logprobs: int | None = None):
    run = generation.start(st, request, req, ids, max_tokens, t0, req.n,
                           json_schema=plan.json_schema if plan else "", top_logprobs=top_logprobs)
    logprobs = top_logprobs is not None

    def whole(finishes: list) -> dict:
        answers = [_answer(j, f, plan, logprobs) for j, f in zip(run.jobs, finishes)]
        return shapes.full(answers, len(ids), run.completion_tokens, run.jobs[0].cached_tokens)

    return await generation.answer(st, run, stream=req.stream, whole=whole,
                                   fmt=CompletionEvents(run, shapes, req, len(ids), plan, logprobs),
                                   refused=(lambda err: schema_error(err, plan.param)) if plan else None)


def _answer(job, finish, plan: structured.Plan | None, logprobs: bool) -> Answer:
    """A finished choice: its text, or the tool call its text is (tools in play)."""
    toks = list(job.toks) if logprobs else None
    if plan is not None and plan.mode != "none":
        call = structured.parse_call(job.text, plan.names)
        if call is not None:
            return Answer(None, "tool_calls", toks, [call])
    return Answer(job.text, finish, toks)


class CompletionEvents:
    """A completions or chat completions stream (a dgr.app.gateway.streaming.StreamFormat): a chat stream
    opens with each choice's role; each piece is a chunk, held back while a choice may still be a tool call
    (structured.CallHold); each choice ends with its finish_reason; then the usage (when
    `stream_options.include_usage`) and `[DONE]`."""

    def __init__(self, run: Run, shapes: Shapes, req, n_prompt: int, plan: structured.Plan | None, logprobs: bool):
        self.run, self.shapes, self.req, self.n_prompt, self.plan, self.logprobs = (
            run, shapes, req, n_prompt, plan, logprobs)
        self.holds = [structured.CallHold(plan) if plan is not None else None for _ in run.jobs]

    def _toks(self, toks):
        return toks if self.logprobs else None

    def opening(self):
        if self.shapes.kind == "chat":
            role = "call" if self.plan is not None and self.plan.mode in ("required", "named") else True
            for i in range(len(self.run.jobs)):
                yield data_event(self.shapes.chunk(None, role=role, index=i))

    def text(self, index: int, piece: Piece):
        hold = self.holds[index]
        out = hold.feed(piece.text, list(piece.toks)) if hold else (piece.text, list(piece.toks))
        if out is not None:
            yield data_event(self.shapes.chunk(out[0], index=index, toks=self._toks(out[1])))

    def done(self, index: int, finish: str):
        if self.holds[index] is not None:
            call, text, toks = self.holds[index].end()
            if call is not None:
                finish = "tool_calls"
                yield data_event(self.shapes.chunk(None, index=index, tool_calls=[call], toks=self._toks(toks)))
            elif text or toks:
                yield data_event(self.shapes.chunk(text, index=index, toks=self._toks(toks)))
        yield data_event(self.shapes.chunk(None, finish, index=index))

    def failed(self, err: GatewayError):
        yield data_event(err.body())

    def closing(self, failed: bool):
        if not failed and self.req.include_usage:
            run = self.run
            yield data_event(self.shapes.usage_chunk(self.n_prompt, run.completion_tokens, run.jobs[0].cached_tokens))
        yield "data: [DONE]\n\n"
