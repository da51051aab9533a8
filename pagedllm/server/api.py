"""The OpenAI-compatible FastAPI app: ``build_app(engine or client, ...)``.

Every request body is read by hand (size limit, strict UTF-8, strict JSON) and validated by the
strict pydantic models of ``protocol``; every refusal is an OpenAI-shaped error
``{"error": {"message", "type", "param", "code"}}`` with a 4xx status naming the field. Requests
are handed to the one ``EngineClient`` (``pagedllm.engine.client``); a client that goes away
(mid-stream or while waiting for a non-streamed answer) aborts its requests in the engine core,
so their KV blocks return to the pool.

This module assembles the app: its state on ``app.state`` (``server``: the ``ServerState``;
``options``: the routes' ``RouteOptions``; ``kv_inspector``), its lifespan, the exception
handlers, and the routers of ``server.routes``, which get that state through FastAPI
dependencies. Request handling and validation live in ``serving``, response shaping and SSE
streaming in ``responses``.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm import __version__
from pagedllm.chat import load_chat_template
from pagedllm.choices import TOOL_CALL_PARSERS
from pagedllm.engine import LLMEngine
from pagedllm.engine.client import EngineClient
from pagedllm.engine.client_inproc import InProcessClient
from pagedllm.logging_utils import init_logger
from pagedllm.server.inspector import KVInspector
from pagedllm.server.openapi import install as install_openapi
from pagedllm.server.routes import (
    chat,
    completions,
    docs,
    health,
    inspector,
    lora,
    models,
    responses,
    scale,
    tokenize,
)
from pagedllm.server.routes.common import RouteOptions
from pagedllm.server.serving import APIError, ServerLimits, ServerState, served_model_name
from pagedllm.server.stats_log import StatsLogger

__all__ = ["APIError", "ServerLimits", "build_app"]

logger = init_logger(__name__)


def build_app(engine: LLMEngine | EngineClient, *, model_name: str | list[str] | None = None,
              api_key: str | None = None,
              limits: ServerLimits | None = None, batch_wait_ms: float = 0.0,
              disable_docs: bool = False, kv_inspector: bool = False,
              kv_inspector_show_text: bool = False,
              tool_call_parser: str | None = None,
              chat_template: str | None = None, log_requests: bool = False,
              allowed_origins: list[str] | None = None,
              log_stats_interval: float | None = None,
              lora_modules: dict[str, str] | None = None,
              allow_runtime_lora_updating: bool = False) -> FastAPI:
    """The app for one engine: an ``EngineClient`` (``pagedllm serve`` passes an ``MPClient``,
    the core in its own process), or an ``LLMEngine``, served by an ``InProcessClient`` (a core
    thread). The client starts and stops with the app's lifespan.
    ``model_name``: the served name, or several (each accepted, the first in responses; default:
    the model path as given, ``default_model`` for the shipped model). The docs pages (/docs,
    /redoc, /openapi.json) need the API key when there is one, and are not served at all with
    ``disable_docs``; /health and /metrics stay open.
    ``kv_inspector``: the live KV page at /kv (``pagedllm.server.inspector``; its data behind the
    key).
    ``tool_call_parser``: one of ``pagedllm.choices.TOOL_CALL_PARSERS`` (tool_choice 'auto' needs
    one);
    ``chat_template``: a Jinja template (file or text) instead of the tokenizer's;
    ``log_requests``: log each request's id, endpoint and sampling parameters;
    ``allowed_origins``: CORS (Starlette's middleware) for these origins ("*": any);
    ``log_stats_interval``: log throughput, queues and KV usage every so many seconds
    (``server.stats_log``; ``pagedllm serve``: 10, off with --disable-log-stats);
    ``lora_modules``: LoRA adapters {name: path} loaded at start-up (needs an engine with
    ``enable_lora``; a bad one fails the start); ``allow_runtime_lora_updating``: serve
    /v1/load_lora_adapter and /v1/unload_lora_adapter (``server.lora``)."""
    template = load_chat_template(chat_template)
    if tool_call_parser not in (None, *TOOL_CALL_PARSERS):
        raise ValueError(f"--tool-call-parser {tool_call_parser!r}: choose "
                         f"{', '.join(TOOL_CALL_PARSERS)}")
    names = [model_name] if isinstance(model_name, str) else list(model_name or [])
    client = engine if isinstance(engine, EngineClient) else InProcessClient(engine, batch_wait_ms)
    srv = ServerState(client, names[0] if names else served_model_name(client.config.model.model),
                      api_key, limits or ServerLimits())
    srv.aliases.update(names)  # several names (--served-model-name A B): each is accepted
    if lora_modules and client.config.lora is None:
        raise ValueError("--lora-modules needs --enable-lora")

    app = FastAPI(title="pagedllm", version=__version__, lifespan=_lifespan, openapi_url=None,
                  docs_url=None, redoc_url=None)  # served by routes.docs, behind the key
    install_openapi(app, bearer=api_key is not None)
    app.state.server = srv
    app.state.options = RouteOptions(tuple(names), template, tool_call_parser, log_requests)
    app.state.engine = engine if isinstance(engine, LLMEngine) else None  # tests' shortcut
    app.state.async_engine = client
    app.state.metrics = srv.metrics
    app.state.kv_inspector = KVInspector(client, kv_inspector_show_text) if kv_inspector else None
    app.state.lora_modules = dict(lora_modules or {})
    app.state.stats_logger = (None if log_stats_interval is None
                              else StatsLogger(client, log_stats_interval))
    _add_error_handlers(app)
    app.add_middleware(_Unhandled)
    app.add_middleware(_Activity, client=client)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"],
                           allow_headers=["*"], allow_credentials="*" not in allowed_origins)

    app.include_router(health.router)
    if not disable_docs:
        app.include_router(docs.router)
    for module in (models, completions, chat, responses):
        app.include_router(module.router)
    if kv_inspector:
        app.include_router(inspector.page_router)
        app.include_router(inspector.router)
    app.include_router(tokenize.router)
    app.include_router(scale.router)
    if allow_runtime_lora_updating:
        app.include_router(lora.router)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    client: EngineClient = app.state.async_engine
    kv: KVInspector | None = app.state.kv_inspector
    stats: StatsLogger | None = app.state.stats_logger
    await client.start()
    srv: ServerState = app.state.server
    for name, path in app.state.lora_modules.items():  # a bad adapter fails the start
        await srv.adapters.load(name, path)
    if kv is not None:
        kv.start()
    stats_task = None if stats is None else asyncio.create_task(stats.run())
    try:
        yield
    finally:
        if stats_task is not None:
            stats_task.cancel()
        if kv is not None:
            await kv.stop()
        await client.shutdown()


def _add_error_handlers(app: FastAPI) -> None:
    """Every refusal in the one OpenAI error shape."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        response = APIError(e.status_code, str(e.detail), type=kind).response()
        response.headers.update(e.headers or {})  # a 405's Allow
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return APIError(400, str(e.errors()[:1])).response()

    @app.exception_handler(ClientDisconnect)
    async def _gone(_: Request, e: ClientDisconnect) -> Response:
        return Response(status_code=499)  # nobody reads it; nothing was queued yet


class _Activity:
    """A request with a body (not a GET: /health, /metrics and pollers change nothing) is the
    front end's work while it runs (``EngineClient.activity``): the process gives back what such
    requests freed once they have all ended, e.g. a 1 MB body refused with a 400 or 413."""

    def __init__(self, app: ASGIApp, client: EngineClient) -> None:
        self.app, self.client = app, client

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        with self.client.activity():
            await self.app(scope, receive, send)


class _Unhandled:
    """An unhandled error is a 500 naming a request id, logged once with that id. (Starlette's
    handler for ``Exception`` re-raises after answering, so uvicorn logged it a second time.)
    Once a response has started nothing can be answered: the error goes on to uvicorn, which
    logs it and closes the connection."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception:
            if started:
                raise
            ref = f"error-{uuid.uuid4().hex}"
            logger.exception("unhandled error (request id %s)", ref)
            response = APIError(500, f"internal server error (request id {ref}); the server log "
                                f"has the details", type="server_error").response()
            await response(scope, receive, send)

