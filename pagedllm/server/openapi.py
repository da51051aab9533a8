"""The OpenAPI document of the app: ``protocol``'s request and response models as components, each
route's body and answers (every refusal in the one error shape), ``/metrics`` as Prometheus text.

The routes read and validate their bodies themselves (``serving.read_json``, ``validate_body``: size
limit, strict UTF-8 and JSON, our messages), so FastAPI is told about the models only for the
document: ``request_body`` for a route's ``openapi_extra``, ``answers`` for its ``responses``.
All models go through one ``models_json_schema`` call, which names a model used both ways apart
if its two schemas differ, and ``install`` adds them to what FastAPI generates.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from pagedllm.server.openai_responses import (
    ResponseObject,
    ResponsesRequest,
    ResponseStreamEvent,
)
from pagedllm.server.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)

_MODELS: list[tuple[type[BaseModel], JsonSchemaMode]] = [
    *((m, "validation") for m in (CompletionRequest, ChatCompletionRequest, TokenizeRequest,
                                  DetokenizeRequest, ResponsesRequest)),
    *((m, "serialization") for m in (CompletionResponse, ChatCompletionResponse, ChatCompletionChunk,
                                     TokenizeResponse, DetokenizeResponse, ModelCard, ModelList, ErrorResponse,
                                     HealthResponse, VersionResponse, ResponseObject,
                                     ResponseStreamEvent)),
]
_REFS, _DEFS = models_json_schema(_MODELS, ref_template="#/components/schemas/{model}")

ERRORS = {
    400: "a bad request: the message names the field (`param`)",
    401: "no or a wrong API key (`Authorization: Bearer <key>`; only with --api-key)",
    404: "the model named is not the one served",
    413: "the body is over --max-request-bytes",
    415: "the body is not sent as `Content-Type: application/json`",
    500: "the engine failed while running the request (the message names its request id)",
    503: "the engine is not running, or the server is shutting down",
}
REFUSALS = (400, 401, 404, 413, 415)  # what any route with a body may answer
GENERATE = (*REFUSALS, 500, 503)  # and a route that runs the engine


def _ref(model: type[BaseModel], mode: JsonSchemaMode) -> dict[str, Any]:
    return dict(_REFS[(model, mode)])


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """A route's ``openapi_extra``: its JSON request body."""
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": _ref(model, "validation")}}}}


def answers(model: type[BaseModel] | None, *statuses: int, stream: type[BaseModel] | None = None,
            stream_end: str = "an ErrorResponse if the engine fails mid-way; `[DONE]` last"
            ) -> dict[int | str, dict[str, Any]]:
    """A route's ``responses``: 200 with ``model`` (or, with ``stream``, server-sent events of
    that chunk when the request says ``"stream": true``, ending as ``stream_end`` says), and the
    error ``statuses``."""
    out: dict[int | str, dict[str, Any]] = {}
    if model is not None:
        content = {"application/json": {"schema": _ref(model, "serialization")}}
        if stream is not None:
            data = {"type": "string", "description": f"a {stream.__name__} as JSON; {stream_end}"}
            content["text/event-stream"] = {"schema": {  # one event (OpenAPI 3.1)
                "type": "object", "required": ["data"], "properties": {"data": data}}}
        out[200] = {"description": "OK", "content": content}
    for status in statuses:
        out[status] = {"description": ERRORS[status],
                       "content": {"application/json": {"schema": _ref(ErrorResponse,
                                                                         "serialization")}}}
    return out


PROMETHEUS: dict[int | str, dict[str, Any]] = {200: {"description": "Prometheus text exposition format",
                    "content": {"text/plain": {"schema": {"type": "string"}}}}}


def install(app: FastAPI, bearer: bool) -> None:
    """``app.openapi()`` returns FastAPI's document with the models added (and, with ``bearer``,
    the API key as a security scheme on every operation that can answer 401)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = doc.setdefault("components", {})
            components.setdefault("schemas", {}).update(_DEFS.get("$defs", {}))
            if bearer:
                components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
                for ops in doc.get("paths", {}).values():
                    for op in ops.values():
                        if "401" in op.get("responses", {}):
                            op["security"] = [{"bearer": []}]
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
