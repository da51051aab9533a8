"""``/health``, ``/version`` and ``/metrics``: open without the API key (probes and scrapers)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from pagedllm import __version__
from pagedllm.server.openapi import PROMETHEUS, answers
from pagedllm.server.protocol import HealthResponse, VersionResponse
from pagedllm.server.routes.common import State
from pagedllm.server.serving import APIError

router = APIRouter()


@router.get("/health", responses=answers(HealthResponse, 503))
async def health(srv: State) -> Response:
    client = srv.async_engine
    if not client.is_running:
        return APIError(503, "the engine is not running; the server log has the details",
                        type="server_error").response()
    if (why := client.degraded) is not None:  # a replica is down; the others serve
        return JSONResponse({"status": "degraded", "detail": why})
    return JSONResponse({"status": "ok"})


@router.get("/version", responses=answers(VersionResponse))
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.get("/metrics", response_class=PlainTextResponse, responses=PROMETHEUS)
async def metrics(srv: State) -> Response:
    return Response(srv.metrics.render(), media_type=CONTENT_TYPE_LATEST)
