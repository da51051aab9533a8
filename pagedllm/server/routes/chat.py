"""``/v1/chat/completions``: a conversation through the chat template -> n choices, with tool
calling (``server.tools``) and structured outputs, streamed or whole."""

from __future__ import annotations

from typing import NamedTuple

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from pagedllm.chat import BOTH_PROMPTS, check_chat_template_kwargs
from pagedllm.engine.client import OutputStream
from pagedllm.server.fields import check_extras, structured_outputs
from pagedllm.server.openapi import GENERATE, answers, request_body
from pagedllm.server.prompts import Budget, chat_prompt
from pagedllm.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
)
from pagedllm.server.responses import (
    SSE_HEADERS,
    ChatChunks,
    chat_logprobs,
    stream_deltas,
    usage_info,
    vllm_prompt_logprobs,
)
from pagedllm.server.routes.common import (
    AUTH,
    Options,
    RouteOptions,
    State,
    log_request,
    no_streamed_prompt_logprobs,
    request_ids,
)
from pagedllm.server.serving import APIError, ClientGone, ServerState, read_json, validate_body
from pagedllm.server.tools import (
    ToolPlan,
    messages_for_template,
    parse_tool_calls,
    tool_finish_reason,
    tool_plan,
)

router = APIRouter(prefix="/v1", dependencies=AUTH)


class ChatRun(NamedTuple):
    """A chat request queued in the engine: its response id, its stream and engine ids, the
    tool plan, the model name to answer with and the logprobs asked (None: none)."""

    rid: str
    stream: OutputStream
    ids: list[str]
    plan: ToolPlan | None
    model: str
    k: int | None


async def start_chat(srv: ServerState, options: RouteOptions, req: ChatCompletionRequest,
                     prefix: str, endpoint: str) -> ChatRun:
    """Check ``req`` (400s name its fields), render its prompt and queue it."""
    srv.check_model(req.model)
    check_extras(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    no_streamed_prompt_logprobs(req)
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError(400, BOTH_PROMPTS, param="continue_final_message")
    max_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    k = (req.top_logprobs or 0) if req.logprobs else None
    so, so_field = structured_outputs(req)
    plan = tool_plan(req, options.tool_call_parser)
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
    prompt = chat_prompt(srv, messages, Budget(max_tokens, max_field, req.truncate_prompt_tokens),
                         add_generation_prompt=req.add_generation_prompt,
                         continue_final_message=req.continue_final_message,
                         tools=plan.tools if plan is not None else None,
                         chat_template=options.chat_template,
                         chat_template_kwargs=req.chat_template_kwargs)
    rid, base = request_ids(req, prefix)
    stream, ids = await srv.submit(base, [prompt], params, req, "messages")
    log_request(options, rid, endpoint, params)
    model = srv.adapters.lora_of(req.model) or srv.model_name  # a LoRA adapter's name, as vLLM
    return ChatRun(rid, stream, ids, plan, model, k)


@router.post("/chat/completions", openapi_extra=request_body(ChatCompletionRequest),
             responses=answers(ChatCompletionResponse, *GENERATE, stream=ChatCompletionChunk))
async def chat_completions(request: Request, srv: State, options: Options) -> Response:
    body = await read_json(request, srv.limits.max_request_bytes)
    req = validate_body(ChatCompletionRequest, body)
    rid, stream, ids, plan, model, k = await start_chat(srv, options, req, "chatcmpl",
                                                        "/v1/chat/completions")
    if req.stream:
        so_opts = req.stream_options
        chunks = ChatChunks(srv, rid, req.n, k, plan, req.return_tokens_as_token_ids, model)
        gen = stream_deltas(srv, stream, chunks,
                            bool(so_opts and so_opts.include_usage),
                            bool(so_opts and so_opts.continuous_usage_stats))
        return StreamingResponse(gen, media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        final = await srv.collect(request, stream, rid)
    except ClientGone:
        return Response(status_code=499)
    out = final[ids[0]]
    choices = []
    for c in out.outputs:
        lp = (chat_logprobs(c, 0, len(c.token_ids), k, req.return_tokens_as_token_ids)
              if k is not None else None)
        content, calls = (c.text, []) if plan is None else parse_tool_calls(plan, c.text)
        choices.append(ChatChoice(
            index=c.index, message=ChatResponseMessage(content=content, tool_calls=calls),
            logprobs=lp, finish_reason=tool_finish_reason(plan, c.finish_reason, calls),
            stop_reason=c.stop_reason))
    usage = usage_info(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs))
    resp = ChatCompletionResponse(id=rid, model=model, choices=choices, usage=usage,
                                  prompt_logprobs=vllm_prompt_logprobs(out))
    return Response(resp.model_dump_json(), media_type="application/json")
