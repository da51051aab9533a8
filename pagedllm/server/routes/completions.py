"""``/v1/completions``: a prompt (text, token ids, or a batch of either) -> n choices each,
streamed or whole."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from pagedllm.server.fields import check_extras, structured_outputs
from pagedllm.server.openapi import GENERATE, answers, request_body
from pagedllm.server.prompts import Budget, completion_prompts
from pagedllm.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from pagedllm.server.responses import (
    SSE_HEADERS,
    CompletionChunks,
    completion_logprobs,
    stream_deltas,
    usage_info,
    vllm_prompt_logprobs,
)
from pagedllm.server.routes.common import (
    AUTH,
    Options,
    State,
    log_request,
    no_streamed_prompt_logprobs,
)
from pagedllm.server.serving import APIError, ClientGone, read_json, validate_body

router = APIRouter(prefix="/v1", dependencies=AUTH)


@router.post("/completions", openapi_extra=request_body(CompletionRequest),
             responses=answers(CompletionResponse, *GENERATE, stream=CompletionResponse))
async def completions(request: Request, srv: State, options: Options) -> Response:
    body = await read_json(request, srv.limits.max_request_bytes)
    req = validate_body(CompletionRequest, body)
    srv.check_model(req.model)
    check_extras(req)
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of must equal n (or be omitted)", param="best_of")
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo with logprobs is not supported", param="echo")
    no_streamed_prompt_logprobs(req)
    so, so_field = structured_outputs(req)
    params = srv.sampling_params(req, req.max_tokens, "max_tokens", req.logprobs, "logprobs", so)
    await srv.check_grammar(so, so_field)
    texts, prompts = completion_prompts(srv, req.prompt, Budget(req.max_tokens))
    rid = f"cmpl-{uuid.uuid4().hex}"
    stream, ids = await srv.submit(rid, prompts, params, req, "prompt")
    log_request(options, rid, "/v1/completions", params)
    index_of = {r: i for i, r in enumerate(ids)}
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        chunks = CompletionChunks(srv, rid, index_of, req.n, texts if req.echo else None,
                                  req.logprobs)
        gen = stream_deltas(srv, stream, chunks, include_usage)
        return StreamingResponse(gen, media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        final = await srv.collect(request, stream, rid)
    except ClientGone:
        return Response(status_code=499)
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for r, p in index_of.items():
        out = final[r]
        prompt_tokens += len(out.prompt_token_ids)
        for c in out.outputs:
            completion_tokens += len(c.token_ids)
            lp = None
            if req.logprobs is not None:
                lp = completion_logprobs(c, 0, len(c.token_ids), req.logprobs, 0)
            text = (texts[p] if req.echo else "") + c.text
            choices.append(CompletionChoice(index=p * req.n + c.index, text=text, logprobs=lp,
                                            finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                            prompt_logprobs=vllm_prompt_logprobs(out)))
    resp = CompletionResponse(id=rid, model=srv.model_name, choices=choices,
                              usage=usage_info(prompt_tokens, completion_tokens))
    return Response(resp.model_dump_json(), media_type="application/json")
