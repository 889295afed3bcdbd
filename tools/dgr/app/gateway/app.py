"""The OpenAI-compatible HTTP app over one route (FastAPI): models, completions, chat completions, the
Responses API (text), health and metrics.

`create_app` builds the state every handler shares (dgr.app.gateway.state: the route, the metrics, the
server's defaults), installs the error handlers (dgr.app.gateway.errors: OpenAI's error shape) and the
metrics middleware, and includes one router per surface (dgr.app.gateway.routes). What a request goes
through, in order: inputs (body, model, prompt ids, budget), generation (the route's sessions, a client
that goes away), streaming (the one SSE loop) or the whole body, in the surface's schemas.
"""

from __future__ import annotations

from fastapi import FastAPI

from dgr import __version__
from dgr.app.gateway import errors
from dgr.app.gateway.limits import DEFAULT_CHAT_MAX_TOKENS
from dgr.app.gateway.metrics import GatewayMetrics, MetricsMiddleware
from dgr.app.gateway.route import RouteBackend
from dgr.app.gateway.routes import completions, models, ops, responses
from dgr.app.gateway.state import GatewayState
from dgr.runtime.wire.drafts import DEFAULT_DRAFT_K

ROUTERS = (models.router, ops.router, completions.router, responses.router)


def create_app(backend: RouteBackend, metrics: GatewayMetrics | None = None, *,
               max_tokens_default: int = DEFAULT_CHAT_MAX_TOKENS, speculate: str | None = None,
               draft_k: int = DEFAULT_DRAFT_K) -> FastAPI:
    """The gateway over `backend`. `max_tokens_default`, `speculate`, `draft_k`: the server's defaults
    (dgr.app.gateway.state.GatewayState)."""
    st = GatewayState.of(backend, metrics, max_tokens_default=max_tokens_default, speculate=speculate,
                         draft_k=draft_k)
    app = FastAPI(title="dgr gateway", version=__version__, docs_url=None, redoc_url=None)
    app.state.gateway = st
    app.add_middleware(MetricsMiddleware, metrics=st.metrics, exact=st.info.exact)
    errors.install(app, st.metrics)
    for router in ROUTERS:
        app.include_router(router)
    return app
