"""For the operator: `GET /health` (what this gateway serves and how: the model, its stages, where its chat
template came from, the stop token ids, the default token budget and speculation) and `GET /metrics`
(Prometheus text, dgr.app.gateway.metrics)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from dgr.app.gateway.state import StateDep

router = APIRouter()


@router.get("/metrics")
async def metrics_text(st: StateDep):
    return Response(st.metrics.render(), media_type=st.metrics.content_type)


@router.get("/health")
async def health(st: StateDep):
    info = st.info
    return {"status": "ok", "model": info.name, "stages": info.stages,
            "chat_template": info.chat_template_source, "stop_token_ids": list(info.eos_ids),
            "max_tokens_default": st.max_tokens_default or None, "speculate": st.speculate or "none",
            "draft_k": st.draft_k if st.speculate else None}
