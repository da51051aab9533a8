"""The OpenAI-compatible FastAPI app: ``build_app(engine or client, ...)``.

Every request body is read by hand (size limit, strict UTF-8, strict JSON) and validated by the
strict pydantic models of ``protocol``; every refusal is an OpenAI-shaped error
``{"error": {"message", "type", "param", "code"}}`` with a 4xx status naming the field. Requests
are handed to the one ``EngineClient`` (``pagedllm.engine.client``); a client that goes away
(mid-stream or while waiting for a non-streamed answer) aborts its requests in the engine core,
so their KV blocks return to the pool.

This module holds the app itself (lifespan, exception handlers, routes); request handling and
validation live in ``serving``, response shaping and SSE streaming in ``responses``.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm import __version__
from pagedllm.chat import check_chat_template_kwargs, load_chat_template
from pagedllm.engine import LLMEngine
from pagedllm.engine.client import EngineClient
from pagedllm.engine.client_inproc import InProcessClient
from pagedllm.logging_utils import init_logger
from pagedllm.server.fields import check_extras, structured_outputs
from pagedllm.server.inspector import KVInspector
from pagedllm.server.inspector import add_routes as add_inspector_routes
from pagedllm.server.openapi import GENERATE, PROMETHEUS, answers, request_body
from pagedllm.server.openapi import install as install_openapi
from pagedllm.server.prompts import Budget, _chat_prompt, _completion_prompts
from pagedllm.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    VersionResponse,
)
from pagedllm.server.responses import (
    _SSE_HEADERS,
    ChatChunks,
    CompletionChunks,
    _chat_logprobs,
    _completion_logprobs,
    _prompt_logprobs,
    _usage,
    stream_deltas,
)
from pagedllm.server.serving import (
    APIError,
    ServerLimits,
    _ClientGone,
    _read_json,
    _Server,
    _validate,
    served_model_name,
)
from pagedllm.server.tokenize import add_tokenize_routes
from pagedllm.server.tools import (
    PARSERS,
    messages_for_template,
    parse_tool_calls,
    tool_finish_reason,
    tool_plan,
)

__all__ = ["APIError", "ServerLimits", "build_app"]

logger = init_logger(__name__)


def build_app(engine: LLMEngine | EngineClient, *, model_name: str | list[str] | None = None,
              api_key: str | None = None,
              limits: ServerLimits | None = None, batch_wait_ms: float = 0.0,
              disable_docs: bool = False, kv_inspector: bool = False,
              kv_inspector_show_text: bool = False,
              tool_call_parser: str | None = None,
              chat_template: str | None = None, log_requests: bool = False) -> FastAPI:
    """The app for one engine: an ``EngineClient`` (``pagedllm serve`` passes an ``MPClient``,
    the core in its own process), or an ``LLMEngine``, served by an ``InProcessClient`` (a core
    thread). The client starts and stops with the app's lifespan.
    ``model_name``: the served name, or several (each accepted, the first in responses; default:
    the model path as given, ``default_model`` for the shipped model). The docs pages (/docs, /redoc, /openapi.json) need the API key when there is
    one, and are not served at all with ``disable_docs``; /health and /metrics stay open.
    ``kv_inspector``: the live KV page at /kv (``pagedllm.server.inspector``; its data behind the
    key).
    ``tool_call_parser``: see ``server.tools.PARSERS`` (tool_choice 'auto' needs one);
    ``chat_template``: a Jinja template (file or text) instead of the tokenizer's;
    ``log_requests``: log each request's id, endpoint and sampling parameters."""
    template = load_chat_template(chat_template)
    if tool_call_parser not in (None, *PARSERS):
        raise ValueError(f"--tool-call-parser {tool_call_parser!r}: choose {', '.join(PARSERS)}")
    names = [model_name] if isinstance(model_name, str) else list(model_name or [])
    client = engine if isinstance(engine, EngineClient) else InProcessClient(engine, batch_wait_ms)
    srv = _Server(client, names[0] if names else served_model_name(client.config.model.model),
                  api_key, limits or ServerLimits())
    srv.aliases.update(names)  # several names (--served-model-name A B): each is accepted
    inspector = KVInspector(srv.async_engine, kv_inspector_show_text) if kv_inspector else None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await srv.async_engine.start()
        if inspector is not None:
            inspector.start()
        try:
            yield
        finally:
            if inspector is not None:
                await inspector.stop()
            await srv.async_engine.shutdown()

    app = FastAPI(title="pagedllm", version=__version__, lifespan=lifespan, openapi_url=None,
                  docs_url=None, redoc_url=None)  # served below, behind the key
    install_openapi(app, bearer=api_key is not None)
    app.state.server = srv
    app.state.engine = engine if isinstance(engine, LLMEngine) else None  # tests' shortcut
    app.state.async_engine = srv.async_engine
    app.state.metrics = srv.metrics
    app.state.kv_inspector = inspector

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

    app.add_middleware(_Unhandled)

    @app.get("/health", responses=answers(HealthResponse, 503))
    async def health() -> Response:
        if not srv.async_engine.is_running:
            return APIError(503, "the engine is not running; the server log has the details",
                            type="server_error").response()
        return JSONResponse({"status": "ok"})

    @app.get("/version", responses=answers(VersionResponse))
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics", response_class=PlainTextResponse, responses=PROMETHEUS)
    async def metrics() -> Response:
        return Response(srv.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    if not disable_docs:
        docs = APIRouter(dependencies=[Depends(srv.check_auth)], include_in_schema=False)

        @docs.get("/openapi.json")
        async def openapi() -> JSONResponse:
            return JSONResponse(app.openapi())

        @docs.get("/docs")
        async def swagger() -> HTMLResponse:
            return get_swagger_ui_html(openapi_url="/openapi.json", title="pagedllm - Swagger UI")

        @docs.get("/redoc")
        async def redoc() -> HTMLResponse:
            return get_redoc_html(openapi_url="/openapi.json", title="pagedllm - ReDoc")

        app.include_router(docs)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(srv.check_auth)])

    @v1.get("/models", responses=answers(ModelList, 401))
    async def models() -> dict[str, Any]:
        ids = [srv.model_name] + [n for n in names[1:] if n != srv.model_name]
        return ModelList(data=[ModelCard(id=i, max_model_len=srv.max_model_len)
                               for i in ids]).model_dump()

    @v1.post("/completions", openapi_extra=request_body(CompletionRequest),
             responses=answers(CompletionResponse, *GENERATE, stream=CompletionResponse))
    async def completions(request: Request) -> Response:
        body = await _read_json(request, srv.limits.max_request_bytes)
        req = _validate(CompletionRequest, body)
        srv.check_model(req.model)
        check_extras(req)
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of must equal n (or be omitted)", param="best_of")
        if req.echo and req.logprobs is not None:
            raise APIError(400, "echo with logprobs is not supported", param="echo")
        _no_streamed_prompt_logprobs(req)
        so, so_field = structured_outputs(req)
        params = srv.sampling_params(req, req.max_tokens, "max_tokens", req.logprobs, "logprobs", so)
        await srv.check_grammar(so, so_field)
        texts, prompts = _completion_prompts(srv, req.prompt, Budget(req.max_tokens))
        rid = f"cmpl-{uuid.uuid4().hex}"
        stream, ids = await srv.submit(rid, prompts, params, req, "prompt")
        if log_requests:
            logger.info("request %s /v1/completions: %s", rid, params)
        index_of = {r: i for i, r in enumerate(ids)}
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            chunks = CompletionChunks(srv, rid, index_of, req.n, texts if req.echo else None,
                                      req.logprobs)
            gen = stream_deltas(srv, stream, chunks, include_usage)
            return StreamingResponse(gen, media_type="text/event-stream", headers=_SSE_HEADERS)
        try:
            final = await srv.collect(request, stream, rid)
        except _ClientGone:
            return Response(status_code=499)
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for r, p in index_of.items():
            out = final[r]
            prompt_tokens += len(out.prompt_token_ids)
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                lp = None
                if req.logprobs is not None:
                    lp = _completion_logprobs(c, 0, len(c.token_ids), req.logprobs, 0)
                text = (texts[p] if req.echo else "") + c.text
                choices.append(CompletionChoice(index=p * req.n + c.index, text=text, logprobs=lp,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                                prompt_logprobs=_prompt_logprobs(out)))
        resp = CompletionResponse(id=rid, model=srv.model_name, choices=choices,
                                  usage=_usage(prompt_tokens, completion_tokens))
        return Response(resp.model_dump_json(), media_type="application/json")

    @v1.post("/chat/completions", openapi_extra=request_body(ChatCompletionRequest),
             responses=answers(ChatCompletionResponse, *GENERATE, stream=ChatCompletionChunk))
    async def chat_completions(request: Request) -> Response:
        body = await _read_json(request, srv.limits.max_request_bytes)
        req = _validate(ChatCompletionRequest, body)
        srv.check_model(req.model)
        check_extras(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        _no_streamed_prompt_logprobs(req)
        max_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        k = (req.top_logprobs or 0) if req.logprobs else None
        so, so_field = structured_outputs(req)
        plan = tool_plan(req, tool_call_parser)
        if plan is not None and plan.constraint is not None:
            if so is not None:
                raise APIError(400, f"{so_field} and tool_choice {plan.mode!r} both constrain the "
                               "output; send one", param=so_field)
            so, so_field = plan.constraint, "tools"
        params = srv.sampling_params(req, max_tokens, max_field, k, "top_logprobs", so)
        await srv.check_grammar(so, so_field)
        try:
            messages = messages_for_template(req.messages)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        try:
            check_chat_template_kwargs(req.chat_template_kwargs)
        except ValueError as e:
            raise APIError(400, str(e), param="chat_template_kwargs") from None
        prompt = _chat_prompt(srv, messages, Budget(max_tokens, max_field),
                              add_generation_prompt=req.add_generation_prompt,
                              tools=plan.tools if plan is not None else None,
                              chat_template=template, chat_template_kwargs=req.chat_template_kwargs)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        stream, ids = await srv.submit(rid, [prompt], params, req, "messages")
        if log_requests:
            logger.info("request %s /v1/chat/completions: %s", rid, params)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            gen = stream_deltas(srv, stream, ChatChunks(srv, rid, req.n, k, plan), include_usage)
            return StreamingResponse(gen, media_type="text/event-stream", headers=_SSE_HEADERS)
        try:
            final = await srv.collect(request, stream, rid)
        except _ClientGone:
            return Response(status_code=499)
        out = final[ids[0]]
        choices = []
        for c in out.outputs:
            lp = _chat_logprobs(c, 0, len(c.token_ids), k) if k is not None else None
            content, calls = (c.text, []) if plan is None else parse_tool_calls(plan, c.text)
            choices.append(ChatChoice(
                index=c.index, message=ChatResponseMessage(content=content, tool_calls=calls),
                logprobs=lp, finish_reason=tool_finish_reason(plan, c.finish_reason, calls),
                stop_reason=c.stop_reason))
        usage = _usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs))
        resp = ChatCompletionResponse(id=rid, model=srv.model_name, choices=choices, usage=usage,
                                      prompt_logprobs=_prompt_logprobs(out))
        return Response(resp.model_dump_json(), media_type="application/json")

    app.include_router(v1)
    if inspector is not None:
        add_inspector_routes(app, inspector, srv.check_auth)
    add_tokenize_routes(app, srv, template)
    return app


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


def _no_streamed_prompt_logprobs(req: CompletionRequest | ChatCompletionRequest) -> None:
    if req.stream and req.prompt_logprobs is not None:
        raise APIError(400, "prompt_logprobs is not available when streaming; send stream=false",
                       param="prompt_logprobs")
