"""What every handler of the gateway works with, in one small object on `app.state.gateway`: the route
(`RouteBackend`: its clients, tokenizer and what the model is, `ModelInfo`, chat template included), the
metrics, the server's defaults (a chat request's token budget, speculation) and the streamed responses still
running. Handlers take it through FastAPI's dependency `gateway_state` (`st: StateDep`), so that a router can
run in an app of its own with the state overridden (`app.dependency_overrides[gateway_state]`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from dgr.app.gateway.limits import DEFAULT_CHAT_MAX_TOKENS
from dgr.app.gateway.metrics import GatewayMetrics
from dgr.app.gateway.route import ModelInfo, RouteBackend, Run
from dgr.app.gateway.schemas.responses import ResponseShape
from dgr.runtime.wire.drafts import DEFAULT_DRAFT_K, check_k


@dataclass
class GatewayState:
    """`max_tokens_default`: the budget of a chat request that gives no max_tokens (0: up to n_ctx).
    `speculate`, `draft_k`: the draft source of a request that names none ("ngram", "mtp"; None: none); a
    request may choose another with `speculate` ("none" turns it off), and one with a JSON schema or tools
    runs without the default (speculation with a grammar is not supported). `live`: the streamed responses
    (/v1/responses) still running, by id, for `POST /v1/responses/{id}/cancel`."""

    backend: RouteBackend
    metrics: GatewayMetrics
    max_tokens_default: int = DEFAULT_CHAT_MAX_TOKENS
    speculate: str | None = None
    draft_k: int = DEFAULT_DRAFT_K
    live: dict[str, tuple[Run, ResponseShape]] = field(default_factory=dict)

    @property
    def info(self) -> ModelInfo:
        return self.backend.info

    @classmethod
    def of(cls, backend: RouteBackend, metrics: GatewayMetrics | None = None, *,
           max_tokens_default: int = DEFAULT_CHAT_MAX_TOKENS, speculate: str | None = None,
           draft_k: int = DEFAULT_DRAFT_K) -> GatewayState:
        """The state of a gateway over `backend`, its settings checked (ValueError says what is wrong)."""
        if max_tokens_default < 0:
            raise ValueError(f"max_tokens_default must be >= 0 (0: up to the context), got {max_tokens_default}")
        info = backend.info
        speculate = None if speculate in (None, "none") else speculate
        if speculate and info.cannot_speculate(speculate):
            raise ValueError(f"--speculate {speculate}: {info.cannot_speculate(speculate)}")
        check_k(draft_k)
        m = metrics or GatewayMetrics(info.name)
        m.exact.set(1 if info.exact else 0)
        return cls(backend, m, max_tokens_default, speculate, draft_k)


async def gateway_state(request: Request) -> GatewayState:
    """The dependency every handler takes (async: resolved on the event loop, not in a worker thread)."""
    return request.app.state.gateway


StateDep = Annotated[GatewayState, Depends(gateway_state)]
