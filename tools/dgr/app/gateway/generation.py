"""A request's generations, from start to answer, the same for every surface: `start` runs n generations of
the prompt along the route (a `Run`, each choice its own session, seeds `seed`+i:
dgr.app.gateway.route.choice_seeds) and watches the request's connection; `answer` waits for the first piece,
so that a route that fails at once gets its HTTP status, then answers the whole body or a stream
(dgr.app.gateway.streaming).

A client that goes away (closes, times out, resets) stops its generation, streaming or not: every request's
connection is checked every DISCONNECT_POLL_S on a timer of its own, whatever the tokens do, and a gone
client's run is cancelled, which closes its sessions along the route (docs/gateway.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import AbstractContextManager

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from dgr.app.gateway import streaming
from dgr.app.gateway.errors import GatewayError, route_error
from dgr.app.gateway.limits import DISCONNECT_POLL_S
from dgr.app.gateway.route import Params, Run, choice_seeds
from dgr.app.gateway.state import GatewayState
from dgr.core.log import get_logger

log = get_logger(__name__)


async def cancel_when_gone(request: Request, run: Run) -> None:
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


def start(st: GatewayState, request: Request, req, ids: list[int], max_tokens: int, t0: float, n: int = 1, *,
          json_schema: str = "", top_logprobs: int | None = None) -> Run:
    """n generations of `ids` (one per choice, seeds `seed`+i), watched for a client that goes away.
    `req`: the request's model (its sampling fields); `t0`: when the request came in (time to first token).
    `top_logprobs`: None, no logprobs; n >= 0, each token's and the n most likely tokens'."""
    seeds = choice_seeds(req.seed, n, req.temperature > 0 and req.top_p > 0)
    stops = tuple(getattr(req, "stops", ()))
    try:
        source = st.info.draft_source(getattr(req, "speculate", None), bool(json_schema), st.speculate)
    except ValueError as err:
        raise GatewayError(400, str(err), param="speculate", code="unsupported_parameter") from None
    k = getattr(req, "draft_k", None) or st.draft_k
    params = [Params(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                     seed=seed, stops=stops, ignore_eos=req.ignore_eos, json_schema=json_schema,
                     logprobs=top_logprobs is not None, top_logprobs=top_logprobs or 0, speculate=source,
                     draft_k=k, prefix_cache=getattr(req, "cache_prompt", True)) for seed in seeds]
    run = Run(st.backend, ids, params, st.metrics, t0)
    # runs until the generations end, whoever serves the response (this coroutine or the stream)
    run.watch = asyncio.create_task(cancel_when_gone(request, run))
    return run


async def answer(st: GatewayState, run: Run, *, stream: bool, whole: Callable[[list], dict],
                 fmt: streaming.StreamFormat, refused: Callable[[Exception], GatewayError | None] | None = None,
                 track: AbstractContextManager | None = None):
    """The answer to a request whose generations `run` is: `whole(finishes)` once every choice has ended (each
    choice's finish reason, in index order), or (`stream`) its pieces as `fmt` writes them. A route that
    fails before the first piece is an error status: `refused(err)` when it is the request's fault (a schema
    the last stage refuses), else the route's. `track`: held while a stream is open."""
    pieces = run.events()
    finishes: list = [None] * len(run.jobs)
    streaming_now = False
    try:
        async for index, what, payload in pieces:
            if what == "error":
                raise (refused(payload) if refused else None) or route_error(payload)
            if run.cancelled:
                return Response(status_code=499)    # nobody reads it: the client has gone
            if stream:
                streaming_now = True
                return StreamingResponse(streaming.stream(run, pieces, (index, what, payload), fmt, st.metrics,
                                                          track),
                                         media_type=streaming.MEDIA_TYPE, headers=streaming.HEADERS)
            if what == "done":
                finishes[index] = payload
        return whole(finishes)
    finally:
        if not streaming_now:
            run.cancel()
