"""``/v1/completions``: a prompt (text, token ids, or a batch of either) -> n choices each,
streamed or whole.

``echo`` with ``logprobs`` returns the prompt's logprobs in OpenAI's shape (the engine's prompt
logprobs; what lm-eval's loglikelihood tasks read), and ``max_tokens: 0`` with ``echo`` returns
the prompt alone: the engine runs one token (its minimum) that the answer leaves out."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from pagedllm.engine.client import FrontEnd
from pagedllm.server.fields import check_extras, structured_outputs
from pagedllm.server.openapi import GENERATE, answers, request_body
from pagedllm.server.prompts import Budget, completion_prompts
from pagedllm.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from pagedllm.server.responses import (
    SSE_HEADERS,
    CompletionChunks,
    completion_logprobs,
    echo_logprobs,
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
    request_ids,
)
from pagedllm.server.serving import APIError, ClientGone, ServerState, read_json, validate_body

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
    echo_lp = req.logprobs if req.echo else None  # the prompt's logprobs, OpenAI's shape
    prompt_only = req.max_tokens == 0
    if prompt_only and not req.echo:
        raise APIError(400, "max_tokens=0 returns the prompt alone: send it with echo=true",
                       param="max_tokens")
    if req.stream and req.echo and (echo_lp is not None or prompt_only
                                    or req.truncate_prompt_tokens is not None):
        raise APIError(400, "echo with logprobs, max_tokens=0 or truncate_prompt_tokens is not "
                       "available when streaming; send stream=false", param="echo")
    no_streamed_prompt_logprobs(req)
    so, so_field = structured_outputs(req)
    max_tokens = 1 if prompt_only else req.max_tokens
    params = srv.sampling_params(req, max_tokens, "max_tokens", req.logprobs, "logprobs", so,
                                 prompt_logprobs=echo_lp)
    await srv.check_grammar(so, so_field)
    texts, prompts = completion_prompts(srv, req.prompt,
                                        Budget(max_tokens, truncate=req.truncate_prompt_tokens))
    rid, base = request_ids(req, "cmpl")
    stream, ids = await srv.submit(base, prompts, params, req, "prompt")
    log_request(options, rid, "/v1/completions", params)
    index_of = {r: i for i, r in enumerate(ids)}
    model = srv.adapters.lora_of(req.model) or srv.model_name  # a LoRA adapter's name, as vLLM
    if req.stream:
        so_opts = req.stream_options
        chunks = CompletionChunks(srv, rid, index_of, req.n, texts if req.echo else None,
                                  req.logprobs, req.return_tokens_as_token_ids, model)
        gen = stream_deltas(srv, stream, chunks, bool(so_opts and so_opts.include_usage),
                            bool(so_opts and so_opts.continuous_usage_stats))
        return StreamingResponse(gen, media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        final = await srv.collect(request, stream, rid)
    except ClientGone:
        return Response(status_code=499)
    outs = [final[r] for r in ids]
    firsts: list[str] = []
    if req.echo:
        sent = texts if req.truncate_prompt_tokens is None else [""] * len(texts)  # decode the cut
        texts, firsts = await _echoed(srv, sent, [o.prompt_token_ids for o in outs])
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for p, out in enumerate(outs):
        prompt_tokens += len(out.prompt_token_ids)
        for c in out.outputs:
            if prompt_only:
                c.text, c.token_ids, c.logprobs, c.stop_reason = "", [], None, None
            completion_tokens += len(c.token_ids)
            lp = None
            if echo_lp is not None:
                lp = echo_logprobs(out, firsts[p], echo_lp, None if prompt_only else c,
                                   req.return_tokens_as_token_ids)
            elif req.logprobs is not None:
                lp = completion_logprobs(c, 0, len(c.token_ids), req.logprobs, 0,
                                         req.return_tokens_as_token_ids)
            text = (texts[p] if req.echo else "") + c.text
            prompt_lps = (vllm_prompt_logprobs(out, req.prompt_logprobs)
                          if req.prompt_logprobs is not None else None)
            choices.append(CompletionChoice(index=p * req.n + c.index, text=text, logprobs=lp,
                                            finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                            prompt_logprobs=prompt_lps))
    resp = CompletionResponse(id=rid, model=model, choices=choices,
                              usage=usage_info(prompt_tokens, completion_tokens))
    return Response(resp.model_dump_json(), media_type="application/json")


async def _echoed(srv: ServerState, texts: list[str],
                  prompt_ids: list[list[int]]) -> tuple[list[str], list[str]]:
    """(the echo of each prompt: its text as sent, or its ids decoded; the text of each prompt's
    first token), on the tokenizer thread."""

    def run(engine: FrontEnd) -> tuple[list[str], list[str]]:
        tok = engine.tokenizer
        echo = [t if t or not ids else str(tok.decode(ids)) for t, ids in zip(texts, prompt_ids)]
        return echo, [str(tok.decode(ids[:1])) for ids in prompt_ids]

    result: tuple[list[str], list[str]] = await srv.async_engine.run_on_tokenizer_thread(run)
    return result
