"""vLLM's ``/tokenize`` and ``/detokenize``: a prompt (or chat messages through the chat
template) -> token ids, and ids -> text, with the model's tokenizer, on the engine client's
tokenizer thread."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from pagedllm.chat import BOTH_PROMPTS, render_chat
from pagedllm.checks import check_token_ids
from pagedllm.engine.client import FrontEnd
from pagedllm.server.openapi import REFUSALS, answers, request_body
from pagedllm.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedllm.server.routes.common import AUTH, Options, State
from pagedllm.server.serving import APIError, ServerState, read_json, validate_body
from pagedllm.server.tools import messages_for_template

router = APIRouter(dependencies=AUTH)


async def _on_tokenizer_thread(srv: ServerState, fn: Any) -> Any:
    try:
        return await srv.async_engine.run_on_tokenizer_thread(fn)
    except ValueError as e:
        raise APIError(400, str(e), param=_param(str(e))) from None


@router.post("/tokenize", openapi_extra=request_body(TokenizeRequest),
             responses=answers(TokenizeResponse, *REFUSALS))
async def tokenize(request: Request, srv: State, options: Options) -> dict[str, Any]:
    req = validate_body(TokenizeRequest, await read_json(request, srv.limits.max_request_bytes))
    srv.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "send exactly one of prompt and messages", param="prompt")
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError(400, BOTH_PROMPTS, param="continue_final_message")
    messages = None
    if req.messages is not None:
        try:
            messages = messages_for_template(req.messages)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None

    def run(engine: FrontEnd) -> dict[str, Any]:
        tok = engine.tokenizer
        if messages is not None:
            ids = render_chat(tok, messages, add_generation_prompt=req.add_generation_prompt,
                              continue_final_message=req.continue_final_message,
                              chat_template=options.chat_template,
                              chat_template_kwargs=req.chat_template_kwargs,
                              add_special_tokens=bool(req.add_special_tokens))
        else:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
        strs = tok.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": srv.max_model_len, "tokens": ids,
                "token_strs": strs}

    return await _on_tokenizer_thread(srv, run)  # type: ignore[no-any-return]


@router.post("/detokenize", openapi_extra=request_body(DetokenizeRequest),
             responses=answers(DetokenizeResponse, *REFUSALS))
async def detokenize(request: Request, srv: State) -> dict[str, Any]:
    req = validate_body(DetokenizeRequest, await read_json(request, srv.limits.max_request_bytes))
    srv.check_model(req.model)

    def run(engine: FrontEnd) -> dict[str, Any]:
        check_token_ids("tokens", req.tokens, engine.config.model.vocab_size)
        return {"prompt": engine.tokenizer.decode(req.tokens)}

    return await _on_tokenizer_thread(srv, run)  # type: ignore[no-any-return]


def _param(message: str) -> str:
    if message.startswith("tokens="):
        return "tokens"
    return "chat_template_kwargs" if "chat_template_kwargs" in message else "messages"
