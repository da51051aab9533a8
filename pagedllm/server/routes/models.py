"""``/v1/models``: the served model under each of its names, then each LoRA adapter served
(``root``: its path, ``parent``: the base model's name); ``/v1/models/{id}``: one of them."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from pagedllm.server.openapi import answers
from pagedllm.server.protocol import ModelCard, ModelList
from pagedllm.server.routes.common import AUTH, Options, State
from pagedllm.server.serving import ServerState

router = APIRouter(prefix="/v1", dependencies=AUTH)


def _card(srv: ServerState, model_id: str) -> ModelCard:
    adapter = srv.adapters.by_name.get(model_id)
    if adapter is None:
        return ModelCard(id=model_id, max_model_len=srv.max_model_len)
    return ModelCard(id=model_id, max_model_len=srv.max_model_len, root=adapter.path,
                     parent=srv.model_name)


@router.get("/models", responses=answers(ModelList, 401))
async def models(srv: State, options: Options) -> dict[str, Any]:
    ids = [srv.model_name] + [n for n in options.names[1:] if n != srv.model_name]
    ids += list(srv.adapters.by_name)
    return ModelList(data=[_card(srv, i) for i in ids]).model_dump()


@router.get("/models/{model_id:path}", responses=answers(ModelCard, 401, 404))
async def model(model_id: str, srv: State) -> dict[str, Any]:
    srv.check_model(model_id)  # a 404 naming the model served
    return _card(srv, model_id).model_dump()
