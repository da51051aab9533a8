"""The API's own documents (``/openapi.json``, ``/docs``, ``/redoc``), behind the API key when
there is one; ``pagedllm serve --disable-fastapi-docs`` leaves this router out."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse

from pagedllm.server.routes.common import AUTH

router = APIRouter(dependencies=AUTH, include_in_schema=False)


@router.get("/openapi.json")
async def openapi(request: Request) -> JSONResponse:
    return JSONResponse(request.app.openapi())


@router.get("/docs")
async def swagger() -> HTMLResponse:
    return get_swagger_ui_html(openapi_url="/openapi.json", title="pagedllm - Swagger UI")


@router.get("/redoc")
async def redoc() -> HTMLResponse:
    return get_redoc_html(openapi_url="/openapi.json", title="pagedllm - ReDoc")
