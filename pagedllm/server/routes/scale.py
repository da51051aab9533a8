"""vLLM's elastic scaling endpoints, behind the API key, for a data-parallel server
(``--data-parallel-size``): ``POST /scale_elastic_ep {"new_data_parallel_size": N,
"drain_timeout": S}`` starts replicas, or takes the newest out of routing, lets their requests
finish (at most S seconds, default 120; then those that streamed nothing go to another replica)
and stops them. The server keeps serving throughout. ``POST /is_scaling_elastic_ep`` says whether
a scaling runs."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from pagedllm.server.openapi import REFUSALS, answers
from pagedllm.server.routes.common import AUTH, State
from pagedllm.server.serving import APIError, read_json, validate_body

router = APIRouter(dependencies=AUTH)


class ScaleRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    new_data_parallel_size: int = Field(ge=1)
    drain_timeout: int = Field(120, ge=1)


@router.post("/scale_elastic_ep", responses=answers(None, *REFUSALS, 500, 503))
async def scale_elastic_ep(request: Request, srv: State) -> JSONResponse:
    req = validate_body(ScaleRequest, await read_json(request, srv.limits.max_request_bytes))
    client = srv.async_engine
    scale = getattr(client, "scale", None)
    if scale is None:
        raise APIError(400, "this server runs one engine core; start it with "
                       "--data-parallel-size 2 or more (or --data-parallel-backend ray) to scale",
                       param="new_data_parallel_size", code="not_data_parallel")
    if srv.scaling:
        raise APIError(400, "a scaling is already running", param="new_data_parallel_size",
                       code="scaling_in_progress")
    srv.scaling = True
    try:
        await scale(req.new_data_parallel_size, req.drain_timeout)
    except RuntimeError as e:  # a replica failed to start: the others serve on
        raise APIError(500, str(e), type="server_error") from None
    finally:
        srv.scaling = False
    return JSONResponse({"message": f"Scaled to {req.new_data_parallel_size} data parallel "
                                    f"engines"})


@router.post("/is_scaling_elastic_ep", responses=answers(None, 401))
async def is_scaling_elastic_ep(srv: State) -> JSONResponse:
    return JSONResponse({"is_scaling_elastic_ep": srv.scaling})
