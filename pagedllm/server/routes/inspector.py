"""The KV inspector's routes (``pagedllm serve --kv-inspector``; ``server.inspector``): ``/kv``,
the page (no data in it, so no key needed to load it; it asks for the key), and its data at
``/kv/state`` and ``/kv/stream``, behind the key as the API is."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

from pagedllm.kv.page import page_html
from pagedllm.server.inspector import KVInspector
from pagedllm.server.responses import SSE_HEADERS
from pagedllm.server.routes.common import AUTH


async def kv_inspector(request: Request) -> KVInspector:
    inspector: KVInspector = request.app.state.kv_inspector
    return inspector


Inspector = Annotated[KVInspector, Depends(kv_inspector)]

page_router = APIRouter(include_in_schema=False)
router = APIRouter(prefix="/kv", dependencies=AUTH, include_in_schema=False)


@page_router.get("/kv")
async def page() -> HTMLResponse:
    return HTMLResponse(page_html())


@router.get("/state")
async def state(inspector: Inspector) -> JSONResponse:
    return JSONResponse(inspector.message(await inspector.fresh()))


@router.get("/stream")
async def stream(inspector: Inspector, history_after: float = 0.0,
                 events_after: int = 0) -> StreamingResponse:
    return StreamingResponse(inspector.stream(history_after, events_after),
                             media_type="text/event-stream", headers=SSE_HEADERS)
