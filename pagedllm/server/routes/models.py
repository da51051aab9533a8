"""``/v1/models``: the served model under each of its names."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from pagedllm.server.openapi import answers
from pagedllm.server.protocol import ModelCard, ModelList
from pagedllm.server.routes.common import AUTH, Options, State

router = APIRouter(prefix="/v1", dependencies=AUTH)


@router.get("/models", responses=answers(ModelList, 401))
async def models(srv: State, options: Options) -> dict[str, Any]:
    ids = [srv.model_name] + [n for n in options.names[1:] if n != srv.model_name]
    return ModelList(data=[ModelCard(id=i, max_model_len=srv.max_model_len)
                           for i in ids]).model_dump()
