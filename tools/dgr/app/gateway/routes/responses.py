"""`POST /v1/responses` (OpenAI's Responses API, text in and text out) and `POST /v1/responses/{id}/cancel`.

The input becomes chat messages rendered by the model's chat template (dgr.app.gateway.schemas.responses), as
on /v1/chat/completions. A stream is the Responses API's event sequence (`event: TYPE` + `data`); a failure
mid-stream is an `error` event, then response.failed. `POST /v1/responses/{id}/cancel` stops a streamed
response that is still running, and answers once every stage has let go (responses are not stored: only a
running stream can be cancelled).
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import contextmanager

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from dgr.app.gateway import generation, inputs
from dgr.app.gateway.errors import GatewayError, schema_error
from dgr.app.gateway.limits import CANCEL_WAIT_S
from dgr.app.gateway.route import Piece, Run
from dgr.app.gateway.schemas.responses import InputRefused, ResponseShape, ResponsesRequest, status_of
from dgr.app.gateway.state import GatewayState, StateDep
from dgr.app.gateway.streaming import typed_event

router = APIRouter()


@router.post("/v1/responses")
async def responses(request: Request, st: StateDep):
    t0 = time.perf_counter()
    req = await inputs.parse(request, ResponsesRequest, st.info)
    try:
        messages = req.messages()
    except InputRefused as err:
        raise GatewayError(400, str(err), param=err.param, code="invalid_value") from None
    ids = await run_in_threadpool(inputs.chat_ids, st.backend, messages, "input")
    budget = inputs.budget(st.info, req.max_output_tokens, len(ids), "input", st.max_tokens_default or None,
                           "max_output_tokens")
    schema = req.json_schema
    run = generation.start(st, request, req, ids, budget, t0,
                           json_schema=json.dumps(schema) if schema is not None else "",
                           top_logprobs=(req.top_logprobs or 0) if req.logprobs else None)
    shape = ResponseShape(st.info.name, req)

    def whole(finishes: list) -> dict:
        job = run.jobs[0]
        return shape.body(status_of(finishes[0], False), job.text, finishes[0], _tokens(job), toks=job.toks)

    return await generation.answer(st, run, stream=req.stream, whole=whole, fmt=ResponseEvents(run, shape),
                                   refused=(lambda err: schema_error(err, "text.format")) if schema is not None
                                   else None,
                                   track=_live(st, run, shape))


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, st: StateDep):
    """Stop a streamed response that is still running: its generation stops at the next token and its
    session closes on every stage before this answers (the response, `status: cancelled`)."""
    found = st.live.get(response_id)
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


def _tokens(job) -> tuple[int, int, int]:
    """(input, output, cached input) tokens of a response's generation, for its usage."""
    return len(job.prompt_ids), job.completion_tokens, job.cached_tokens


@contextmanager
def _live(st: GatewayState, run: Run, shape: ResponseShape):
    """A streamed response can be cancelled by its id while its stream is open."""
    st.live[shape.id] = (run, shape)
    try:
        yield
    finally:
        st.live.pop(shape.id, None)


class ResponseEvents:
    """A Responses API stream (a dgr.app.gateway.streaming.StreamFormat) of one message: created, in_progress,
    the item and its part added; a delta per piece; then the text, part and item done and response.completed
    or response.incomplete (max_output_tokens, or cancelled); a route that fails: `error`, response.failed."""

    def __init__(self, run: Run, shape: ResponseShape):
        self.job, self.shape = run.jobs[0], shape

    def opening(self):
        return [typed_event(ev) for ev in self.shape.opening()]

    def text(self, index: int, piece: Piece):
        return [typed_event(self.shape.delta(piece.text, piece.toks))]

    def done(self, index: int, finish: str):
        job = self.job
        status = status_of(finish, job.cancelled_by_request)
        return [typed_event(ev) for ev in self.shape.closing(job.text, status, finish, _tokens(job), job.toks)]

    def failed(self, err: GatewayError):
        job = self.job
        return [typed_event(ev) for ev in self.shape.failure(err.body()["error"], job.text, _tokens(job))]

    def closing(self, failed: bool):
        return ()
