"""The one stream of the gateway: a route's generated pieces as server-sent events, for every surface.

`stream` reads a request's `Run` (its pieces in arrival order; the stop strings were already applied as the
route's text came in: dgr.app.gateway.route, dgr.app.gateway.stops) and writes what a `StreamFormat` makes
of each: the opening events, a piece of text, a choice that finished, a route that failed mid-stream, the
closing events. A failure after the stream started is counted in `errors_total` and ends the stream (after
the format's error event; the closing events are told it failed). However the stream ends (done, failed, or
its client gone: Starlette stops reading), the run is cancelled, which closes its sessions along the route,
and `open_streams` goes down.

The formats: /v1/completions and /v1/chat/completions (dgr.app.gateway.routes.completions: `data: {chunk}`
events, then `data: [DONE]`) and /v1/responses (dgr.app.gateway.routes.responses: `event: TYPE` + `data`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

from dgr.app.gateway.errors import GatewayError, route_error
from dgr.app.gateway.metrics import GatewayMetrics
from dgr.app.gateway.route import Piece, Run

# what a streamed response carries besides its events: no caching, no buffering by a proxy (nginx)
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MEDIA_TYPE = "text/event-stream"


def data_event(obj) -> str:
    """An unnamed event: `data: JSON`."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def typed_event(event: dict) -> str:
    """A named event (the Responses API's): `event: TYPE` + `data: JSON`."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


class StreamFormat(Protocol):
    """A surface's events (each a whole SSE event, framed by data_event or typed_event)."""

    def opening(self) -> Iterable[str]:
        """Before the first piece."""

    def text(self, index: int, piece: Piece) -> Iterable[str]:
        """A piece of choice `index`'s text (and its tokens, when logprobs are asked)."""

    def done(self, index: int, finish: str) -> Iterable[str]:
        """Choice `index` ended ("stop" or "length")."""

    def failed(self, err: GatewayError) -> Iterable[str]:
        """The route failed mid-stream; nothing but the closing events follows."""

    def closing(self, failed: bool) -> Iterable[str]:
        """After the last choice ended (or the route failed)."""


async def stream(run: Run, events: AsyncIterator, first: tuple, fmt: StreamFormat, metrics: GatewayMetrics,
                 track: AbstractContextManager | None = None) -> AsyncIterator[str]:
    """`run`'s events as `fmt` writes them: `first` is the (index, kind, payload) already read from `events`
    (the request waited for it before answering). `track`: held while the stream is open (the Responses API's
    table of streams that can be cancelled)."""
    metrics.open_streams.inc()
    try:
        with track if track is not None else nullcontext():
            for ev in fmt.opening():
                yield ev
            item, failed = first, False
            while item is not None:
                index, what, payload = item
                if what == "text":
                    for ev in fmt.text(index, payload):
                        yield ev
                elif what == "error":
                    err = route_error(payload)
                    metrics.error(err.code or err.type)
                    for ev in fmt.failed(err):
                        yield ev
                    failed = True
                    break
                elif what == "done":
                    for ev in fmt.done(index, payload):
                        yield ev
                item = await anext(events, None)
            for ev in fmt.closing(failed):
                yield ev
    finally:
        run.cancel()                        # a client that went away: its sessions close along the route
        metrics.open_streams.dec()
        await events.aclose()
