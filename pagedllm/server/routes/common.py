"""What every route module shares: the dependencies that hand a route the app's state
(``app.state.server``, ``app.state.options``, ``app.state.kv_inspector``), the API-key check, and
the checks two endpoints share."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from pagedllm.logging_utils import init_logger
from pagedllm.server.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.server.serving import APIError, ServerState

logger = init_logger("pagedllm.server.routes")


@dataclass(frozen=True)
class RouteOptions:
    """Per-app settings of the routes (``build_app``'s arguments, checked there).

    ``names``: every served model name, the first in responses; ``chat_template``: the loaded
    template text (None: the tokenizer's); ``tool_call_parser``: one of
    ``pagedllm.choices.TOOL_CALL_PARSERS``."""

    names: tuple[str, ...]
    chat_template: str | None = None
    tool_call_parser: str | None = None
    log_requests: bool = False


# The dependencies are ``async def``: FastAPI runs a plain ``def`` one in its thread pool, a thread
# hop per dependency per request, and under a burst each hop sends the request to the back of the
# event loop's queue (128 requests at once reached the engine only after ~300 ms).


async def server_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state


async def route_options(request: Request) -> RouteOptions:
    options: RouteOptions = request.app.state.options
    return options


async def require_key(request: Request) -> None:
    """The API-key check (a router's dependency): a 401 unless the key matches, when there is one."""
    state: ServerState = request.app.state.server
    state.check_auth(request)


State = Annotated[ServerState, Depends(server_state)]
Options = Annotated[RouteOptions, Depends(route_options)]
AUTH = [Depends(require_key)]


def no_streamed_prompt_logprobs(req: CompletionRequest | ChatCompletionRequest) -> None:
    if req.stream and req.prompt_logprobs is not None:
        raise APIError(400, "prompt_logprobs is not available when streaming; send stream=false",
                       param="prompt_logprobs")


def log_request(options: RouteOptions, rid: str, endpoint: str, params: object) -> None:
    if options.log_requests:
        logger.info("request %s %s: %s", rid, endpoint, params)


def request_ids(req: CompletionRequest | ChatCompletionRequest, prefix: str) -> tuple[str, str]:
    """(the response's id: the request's ``request_id`` or a fresh one; the engine's base id,
    unique even when two requests send the same ``request_id``)."""
    fresh = uuid.uuid4().hex
    if req.request_id is None:
        return f"{prefix}-{fresh}", f"{prefix}-{fresh}"
    return req.request_id, f"{req.request_id}-{fresh[:12]}"
