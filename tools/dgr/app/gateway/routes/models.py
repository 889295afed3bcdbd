"""`GET /v1/models` and `GET /v1/models/{model}`: the one model this gateway serves (its name or its
bundle id; any other is a 404 `model_not_found`)."""

from __future__ import annotations

from fastapi import APIRouter

from dgr.app.gateway.inputs import check_model
from dgr.app.gateway.schemas.common import model_list
from dgr.app.gateway.state import StateDep

router = APIRouter()


@router.get("/v1/models")
async def models(st: StateDep):
    return model_list(st.info.name, st.info.created)


@router.get("/v1/models/{model:path}")
async def model(model: str, st: StateDep):
    check_model(st.info, model)
    return model_list(st.info.name, st.info.created)["data"][0]
