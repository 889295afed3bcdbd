"""The gateway's errors as the client sees them, and the app's handlers that answer them.

Every error answers OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: 400 for a bad
request (bad JSON, bad field, over-long prompt, n_ctx exceeded, a chat template that refuses the
messages), 404 for an unknown model or URL, 405 for a method a URL does not take, 502/503 for a route that
fails (the typed WireError's message; an unreachable hop: 503 `hop_unreachable` + Retry-After, its gRPC
details only in the log). Each error is counted in `errors_total{code}` (dgr.app.gateway.metrics). A failure
after a stream started is the stream's own event (dgr.app.gateway.streaming).
"""

from __future__ import annotations

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dgr.app.gateway import limits, structured
from dgr.app.gateway.metrics import GatewayMetrics
from dgr.app.gateway.schemas.common import error_body
from dgr.core.errors import DgrError, WireError
from dgr.core.log import get_logger
from dgr.runtime.wire.errors import HopUnreachable, Overloaded, StageError

log = get_logger(__name__)


class GatewayError(DgrError):
    """An error the client sees: HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def route_error(err: Exception) -> GatewayError:
    """A failure of the route (or of the gateway) as the client sees it."""
    if isinstance(err, GatewayError):
        return err
    if isinstance(err, Overloaded):
        after = max(1, round(err.retry_after_ms / 1000)) if err.retry_after_ms else 1
        return GatewayError(503, str(err), "server_error", code="overloaded", headers={"Retry-After": str(after)})
    if isinstance(err, (HopUnreachable, grpc.RpcError)):     # RpcError: a call the route client did not map
        log.warning("gateway: %s", err)                 # the route's message (gRPC's details) is for the log
        after = limits.HOP_RETRY_AFTER_S
        return GatewayError(503, f"{getattr(err, 'hop', '') or 'a stage of the route'} cannot be reached: its worker "
                                 f"is down, restarting or not answering; retry after {after} s", "server_error",
                            code="hop_unreachable", headers={"Retry-After": str(after)})
    if isinstance(err, StageError):
        return GatewayError(502, str(err), "server_error", code=err.code.lower())
    if isinstance(err, WireError):
        return GatewayError(502, str(err), "server_error", code="route_error")
    return GatewayError(500, f"the gateway failed ({type(err).__name__}); see its log", "server_error",
                        code="internal_error")


def schema_error(err: Exception, param: str) -> GatewayError | None:
    """The last stage refusing the request's schema (llama.cpp's json_schema_to_grammar could not make a
    grammar of it) as the request's fault: a 400 naming the field the schema came from."""
    why = structured.schema_refused(err, param)
    if why is None:
        return None
    return GatewayError(400, f"Invalid schema for '{param}': the route cannot constrain output with it: {why}",
                        param=param, code="invalid_schema")


def install(app: FastAPI, metrics: GatewayMetrics) -> None:
    """Answer every error `app` raises in OpenAI's shape, counted in `metrics`."""

    def fail(err: GatewayError) -> JSONResponse:
        metrics.error(err.code or err.type)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, err: GatewayError):
        return fail(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):
        if err.status_code == 404:
            return fail(GatewayError(404, f"Unknown request URL: {request.method} {request.url.path}",
                                     code="unknown_url"))
        if err.status_code == 405:
            return fail(GatewayError(405, f"Method {request.method} is not allowed on {request.url.path}",
                                     code="method_not_allowed"))
        return fail(GatewayError(err.status_code, str(err.detail)))

    @app.exception_handler(WireError)
    @app.exception_handler(grpc.RpcError)
    async def _route_failed(request: Request, err: Exception):
        return fail(route_error(err))

    # anything else: a 500 that Starlette then re-raises, and uvicorn closes the connection (APIConnectionError)
    @app.exception_handler(Exception)
    async def _internal(request: Request, err: Exception):
        log.exception("gateway: %s %s failed", request.method, request.url.path)
        return fail(route_error(err))
