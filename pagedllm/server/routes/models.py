"""``/v1/models``: the served model under each of its names; ``/v1/models/{id}``: one of them."""

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


@router.get("/models/{model_id:path}", responses=answers(ModelCard, 401, 404))
async def model(model_id: str, srv: State) -> dict[str, Any]:
    srv.check_model(model_id)  # a 404 naming the model served
    return ModelCard(id=model_id, max_model_len=srv.max_model_len).model_dump()
