"""The OpenAI-compatible FastAPI app: ``build_app(engine, ...)``.

Every request body is read by hand (size limit, strict UTF-8, strict JSON) and validated by the
strict pydantic models of ``protocol``; every refusal is an OpenAI-shaped error
``{"error": {"message", "type", "param", "code"}}`` with a 4xx status naming the field. Requests
are handed to the one ``AsyncEngine``; a client that goes away (mid-stream or while waiting for a
non-streamed answer) aborts its requests, so their KV blocks return to the pool.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from pagedllm import __version__
from pagedllm.engine import LLMEngine, PromptType
from pagedllm.logging_utils import init_logger
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.server.async_engine import AsyncEngine, EngineError, OutputStream, PromptSource
from pagedllm.server.metrics import ServerMetrics
from pagedllm.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    TopLogprob,
    UsageInfo,
    _SamplingFields,
)

logger = init_logger(__name__)

MAX_SEED = 2**63 - 1024  # room for seed + i over n samples inside torch's int64 range
LOGPROB_FLOOR = -9999.0  # JSON has no -inf


@dataclass(frozen=True)
class ServerLimits:
    """Per-request limits; anything above is a 400 naming the field."""

    max_request_bytes: int = 1 << 20
    max_n: int = 16
    max_tokens: int | None = None  # None: max_model_len
    max_prompt_tokens: int | None = None  # None: max_model_len - 1
    max_prompts: int = 32  # prompts in one /v1/completions batch


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code))
        return JSONResponse(body.model_dump(), status_code=self.status)


class _ClientGone(Exception):
    pass


M = TypeVar("M", bound=BaseModel)


# -- request parsing -----------------------------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def _read_json(request: Request, limit: int) -> dict[str, Any]:
    cl = request.headers.get("content-length")
    if cl is not None and cl.isdigit() and int(cl) > limit:
        raise APIError(400, f"the request body has {cl} bytes; the limit is {limit} (--max-request-bytes)",
                       param="body", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(400, f"the request body exceeds {limit} bytes (--max-request-bytes)",
                           param="body", code="request_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {e.start})", param="body",
                       code="invalid_encoding") from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", param="body",
                       code="invalid_json") from None
    if not isinstance(obj, dict):
        raise APIError(400, "the request body must be a JSON object", param="body", code="invalid_json")
    return obj


def _validate(model: type[M], body: dict[str, Any]) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errs = e.errors(include_url=False)
        first = errs[0]
        loc = [str(x) for x in first["loc"]]
        param = loc[0] if loc else None
        where = ".".join(loc) or "body"
        more = f" (and {len(errs) - 1} more problems)" if len(errs) > 1 else ""
        raise APIError(400, f"{where}: {first['msg']}{more}", param=param, code="invalid_value") from None


def _field_of(message: str) -> str | None:
    m = re.match(r"([a-z_]+)=", message)
    return m.group(1) if m else None


def _nonfinite(name: str, value: float | None) -> None:
    if value is not None and not math.isfinite(value):
        raise APIError(400, f"{name}={value} is invalid; give a finite number", param=name)


# -- app ------------------------------------------------------------------------------------------


class _Server:
    """Request handling state for one app (engine, limits, names)."""

    def __init__(self, engine: LLMEngine, model_name: str, api_key: str | None, limits: ServerLimits,
                 batch_wait_ms: float) -> None:
        self.engine = engine
        self.model_name = model_name
        self.aliases = {model_name, Path(model_name).name}
        self.api_key = api_key
        self.limits = limits
        self.max_model_len = engine.config.scheduler.max_model_len
        self.vocab_size = engine.config.model.vocab_size
        self.metrics = ServerMetrics(engine, model_name)
        self.async_engine = AsyncEngine(engine, self.metrics, batch_wait_ms)

    # -- checks ------------------------------------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())
        if not ok:
            raise APIError(401, "missing or incorrect API key; send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.aliases:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def sampling_params(self, req: _SamplingFields, max_tokens: int | None, max_tokens_field: str,
                        logprobs: int | None, logprobs_field: str) -> SamplingParams:
        lim = self.limits
        if req.n > lim.max_n:
            raise APIError(400, f"n={req.n} exceeds this server's limit of {lim.max_n} (--max-n)", param="n")
        cap = min(lim.max_tokens or self.max_model_len, self.max_model_len)
        if max_tokens is not None and max_tokens > cap:
            raise APIError(400, f"{max_tokens_field}={max_tokens} exceeds this server's limit of {cap}",
                           param=max_tokens_field)
        if max_tokens is None and lim.max_tokens is not None:
            max_tokens = cap
        if req.seed is not None and not 0 <= req.seed <= MAX_SEED:
            raise APIError(400, f"seed={req.seed} is invalid; must be in [0, {MAX_SEED}]", param="seed")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            _nonfinite(name, getattr(req, name))
        if req.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
        top_k = req.top_k
        if top_k is not None and top_k >= self.vocab_size:
            top_k = 0  # keeping the whole vocabulary is no top-k at all
        kwargs: dict[str, Any] = dict(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if top_k is None else top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=req.seed,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
        )
        try:
            return SamplingParams(**kwargs)
        except ValueError as e:
            param = _field_of(str(e))
            msg = str(e)
            if param == "max_tokens" and max_tokens_field != "max_tokens":
                param = max_tokens_field
            if param == "logprobs":
                param = logprobs_field
                msg = msg.replace("logprobs=", f"{logprobs_field}=", 1)
            raise APIError(400, msg, param=param) from None

    def prompt_checker(self, ids: list[int], param: str) -> None:
        lim = self.limits.max_prompt_tokens
        if lim is not None and len(ids) > lim:
            raise ValueError(f"{param} has {len(ids)} tokens; this server accepts at most {lim} "
                             f"(--max-prompt-tokens)")

    # -- submission --------------------------------------------------------------------------------
    async def submit(self, base_id: str, prompts: list[PromptSource], params: SamplingParams,
                     priority: int, param: str) -> tuple[OutputStream, list[str]]:
        stream = OutputStream()
        ids: list[str] = []
        try:
            for i, p in enumerate(prompts):
                rid = f"{base_id}-{i}"
                await self.async_engine.add_request(rid, p, params, stream, priority)
                ids.append(rid)
        except ValueError as e:
            self.async_engine.abort_stream(stream)
            raise APIError(400, str(e), param=param, code="invalid_prompt") from None
        except EngineError as e:
            self.async_engine.abort_stream(stream)
            raise APIError(503, str(e), type="server_error", code="engine_unavailable") from None
        except BaseException:
            self.async_engine.abort_stream(stream)
            raise
        return stream, ids

    async def collect(self, request: Request, stream: OutputStream) -> dict[str, RequestOutput]:
        """Wait for the final outputs; abort everything if the client disconnects first."""
        final: dict[str, RequestOutput] = {}

        async def consume() -> None:
            async for out in stream:
                if out.finished:
                    final[out.request_id] = out

        consumer = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if consumer in done:
                try:
                    consumer.result()
                except EngineError as e:
                    raise APIError(500, str(e), type="server_error", code="engine_error") from None
                return final
            raise _ClientGone()
        finally:
            watcher.cancel()
            consumer.cancel()
            self.async_engine.abort_stream(stream)


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _sse(obj: BaseModel | dict[str, Any]) -> str:
    data = obj.model_dump_json() if isinstance(obj, BaseModel) else json.dumps(obj)
    return f"data: {data}\n\n"


def _lp(v: float) -> float:
    return v if v == v and v > LOGPROB_FLOOR else LOGPROB_FLOOR


def _ranked(pos: dict[int, Any], k: int) -> list[Any]:
    return sorted((x for x in pos.values() if x.rank is not None and x.rank <= k), key=lambda x: x.rank)


def _completion_logprobs(c: CompletionOutput, start: int, end: int, k: int, offset: int,
                         decode: Callable[[int], str]) -> CompletionLogProbs | None:
    if c.logprobs is None:
        return None
    out = CompletionLogProbs()
    for tid, pos in zip(c.token_ids[start:end], c.logprobs[start:end]):
        chosen = pos.get(tid)
        tok = chosen.decoded_token if chosen is not None and chosen.decoded_token is not None else decode(tid)
        out.tokens.append(tok)
        out.token_logprobs.append(_lp(chosen.logprob) if chosen is not None else None)
        out.top_logprobs.append({(x.decoded_token or decode(t)): _lp(x.logprob)
                                 for t, x in sorted(pos.items(), key=lambda i: i[1].rank or 0)
                                 if x.rank is not None and x.rank <= k})
        out.text_offset.append(offset)
        offset += len(tok)
    return out


def _chat_logprobs(c: CompletionOutput, start: int, end: int, k: int,
                   decode: Callable[[int], str]) -> ChatLogprobs | None:
    if c.logprobs is None:
        return None
    content = []
    for tid, pos in zip(c.token_ids[start:end], c.logprobs[start:end]):
        chosen = pos.get(tid)
        tok = chosen.decoded_token if chosen is not None and chosen.decoded_token is not None else decode(tid)
        top = [TopLogprob(token=x.decoded_token or "", logprob=_lp(x.logprob),
                          bytes=list((x.decoded_token or "").encode()))
               for x in _ranked(pos, k)]
        content.append(ChatTokenLogprob(token=tok, logprob=_lp(chosen.logprob) if chosen else LOGPROB_FLOOR,
                                        bytes=list(tok.encode()), top_logprobs=top))
    return ChatLogprobs(content=content)


def _usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def build_app(engine: LLMEngine, *, model_name: str | None = None, api_key: str | None = None,
              limits: ServerLimits | None = None, batch_wait_ms: float = 0.0) -> FastAPI:
    """The app for one engine. The engine thread starts and stops with the app's lifespan."""
    srv = _Server(engine, model_name or engine.config.model.model, api_key, limits or ServerLimits(),
                  batch_wait_ms)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        srv.async_engine.start()
        try:
            yield
        finally:
            await srv.async_engine.shutdown()

    app = FastAPI(title="pagedllm", version=__version__, lifespan=lifespan)
    app.state.server = srv
    app.state.engine = engine
    app.state.async_engine = srv.async_engine
    app.state.metrics = srv.metrics

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return APIError(e.status_code, str(e.detail), type=kind).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return APIError(400, str(e.errors()[:1])).response()

    @app.exception_handler(ClientDisconnect)
    async def _gone(_: Request, e: ClientDisconnect) -> Response:
        return Response(status_code=499)  # nobody reads it; nothing was queued yet

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return APIError(500, f"internal server error: {type(e).__name__}", type="server_error").response()

    @app.get("/health")
    async def health() -> Response:
        if not srv.async_engine.is_running:
            return APIError(503, "the engine is not running", type="server_error").response()
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(srv.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(srv.check_auth)])

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        return ModelList(data=[ModelCard(id=srv.model_name, max_model_len=srv.max_model_len)]).model_dump()

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        body = await _read_json(request, srv.limits.max_request_bytes)
        req = _validate(CompletionRequest, body)
        srv.check_model(req.model)
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of must equal n (or be omitted)", param="best_of")
        if req.echo and req.logprobs is not None:
            raise APIError(400, "echo with logprobs is not supported", param="echo")
        params = srv.sampling_params(req, req.max_tokens, "max_tokens", req.logprobs, "logprobs")
        texts, prompts = _completion_prompts(srv, req.prompt)
        stream, ids = await srv.submit(f"cmpl-{uuid.uuid4().hex}", prompts, params, req.priority, "prompt")
        rid = ids[0].rsplit("-", 1)[0]
        index_of = {r: i for i, r in enumerate(ids)}
        decode = _decoder(engine)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            gen = _stream_completion(srv, stream, rid, index_of, req.n, texts if req.echo else None,
                                     req.logprobs, include_usage, decode)
            return StreamingResponse(gen, media_type="text/event-stream", headers=_SSE_HEADERS)
        try:
            final = await srv.collect(request, stream)
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
                    lp = _completion_logprobs(c, 0, len(c.token_ids), req.logprobs, 0, decode)
                text = (texts[p] if req.echo else "") + c.text
                choices.append(CompletionChoice(index=p * req.n + c.index, text=text, logprobs=lp,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        resp = CompletionResponse(id=rid, model=srv.model_name, choices=choices,
                                  usage=_usage(prompt_tokens, completion_tokens))
        return Response(resp.model_dump_json(), media_type="application/json")

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await _read_json(request, srv.limits.max_request_bytes)
        req = _validate(ChatCompletionRequest, body)
        srv.check_model(req.model)
        if req.tools:
            raise APIError(400, "tools are not supported", param="tools")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise APIError(400, "only response_format type 'text' is supported", param="response_format")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        max_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        k = (req.top_logprobs or 0) if req.logprobs else None
        params = srv.sampling_params(req, max_tokens, max_field, k, "top_logprobs")
        try:
            messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                        for m in req.messages]
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        prompt = _chat_prompt(srv, messages, req.add_generation_prompt)
        stream, ids = await srv.submit(f"chatcmpl-{uuid.uuid4().hex}", [prompt], params, req.priority,
                                       "messages")
        rid = ids[0].rsplit("-", 1)[0]
        decode = _decoder(engine)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            gen = _stream_chat(srv, stream, rid, req.n, k, include_usage, decode)
            return StreamingResponse(gen, media_type="text/event-stream", headers=_SSE_HEADERS)
        try:
            final = await srv.collect(request, stream)
        except _ClientGone:
            return Response(status_code=499)
        out = final[ids[0]]
        choices = []
        for c in out.outputs:
            lp = _chat_logprobs(c, 0, len(c.token_ids), k, decode) if k is not None else None
            choices.append(ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text), logprobs=lp,
                                      finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        usage = _usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs))
        resp = ChatCompletionResponse(id=rid, model=srv.model_name, choices=choices, usage=usage)
        return Response(resp.model_dump_json(), media_type="application/json")

    app.include_router(v1)
    return app


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _decoder(engine: LLMEngine) -> Callable[[int], str]:
    """Fallback text for a token whose Logprob has no ``decoded_token`` (the engine always fills
    it today). The tokenizer itself is only used on the engine thread."""
    return lambda tid: f"<token {tid}>"


def _completion_prompts(srv: _Server, prompt: str | list[str] | list[int] | list[list[int]]
                        ) -> tuple[list[str], list[PromptSource]]:
    """(texts for echo, prompt sources). Strings are tokenized on the engine thread."""
    items: list[str | list[int]]
    if isinstance(prompt, str):
        items = [prompt]
    elif not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    elif all(isinstance(p, int) for p in prompt):
        items = [prompt]  # type: ignore[list-item]
    else:
        items = list(prompt)  # type: ignore[arg-type]
    if len(items) > srv.limits.max_prompts:
        raise APIError(400, f"{len(items)} prompts in one request; the limit is {srv.limits.max_prompts}",
                       param="prompt")
    texts, sources = [], []
    for item in items:
        if isinstance(item, str):
            texts.append(item)
            sources.append(_text_prompt(srv, item, True, "prompt"))
        else:
            texts.append("")
            sources.append(_ids_prompt(srv, list(item)))
    return texts, sources


def _text_prompt(srv: _Server, text: str, add_special_tokens: bool, param: str) -> PromptSource:
    def prepare(engine: LLMEngine) -> PromptType:
        ids = engine.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        srv.prompt_checker(ids, param)
        return {"prompt_token_ids": ids}

    return prepare


def _ids_prompt(srv: _Server, ids: list[int]) -> PromptSource:
    def prepare(engine: LLMEngine) -> PromptType:
        srv.prompt_checker(ids, "prompt")
        return {"prompt_token_ids": ids}

    return prepare


def _chat_prompt(srv: _Server, messages: list[dict[str, Any]], add_generation_prompt: bool) -> PromptSource:
    def prepare(engine: LLMEngine) -> PromptType:
        tok = engine.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat_template; use /v1/completions")
        try:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - template errors (jinja raise_exception) are bad input
            raise ValueError(f"the chat template rejected these messages: {e}") from None
        ids = tok.encode(text, add_special_tokens=False)
        srv.prompt_checker(ids, "messages")
        return {"prompt_token_ids": ids}

    return prepare


def _error_event(e: BaseException) -> str:
    body = ErrorResponse(error=ErrorInfo(message=str(e), type="server_error", code="engine_error"))
    return _sse(body) + "data: [DONE]\n\n"


async def _stream_completion(srv: _Server, stream: OutputStream, rid: str, index_of: dict[str, int], n: int,
                             echo: list[str] | None, logprobs: int | None, include_usage: bool,
                             decode: Callable[[int], str]) -> AsyncIterator[str]:
    created = int(time.time())
    sent_text: dict[int, int] = {}
    sent_tok: dict[int, int] = {}
    done: set[int] = set()
    prompt_tokens: dict[int, int] = {}
    try:
        async for out in stream:
            p = index_of[out.request_id]
            prompt_tokens[p] = len(out.prompt_token_ids)
            for c in out.outputs:
                idx = p * n + c.index
                if idx in done:
                    continue
                first = idx not in sent_text
                t0, k0 = sent_text.get(idx, 0), sent_tok.get(idx, 0)
                delta = c.text[t0:]
                if first and echo is not None:
                    delta = echo[p] + delta
                if not delta and not c.finished:
                    continue
                lp = None
                if logprobs is not None:
                    lp = _completion_logprobs(c, k0, len(c.token_ids), logprobs, t0, decode)
                sent_text[idx], sent_tok[idx] = len(c.text), len(c.token_ids)
                if c.finished:
                    done.add(idx)
                chunk = CompletionResponse(
                    id=rid, created=created, model=srv.model_name,
                    choices=[CompletionChoice(index=idx, text=delta, logprobs=lp, finish_reason=c.finish_reason,
                                              stop_reason=c.stop_reason)])
                yield _sse(chunk)
        if include_usage:
            usage = _usage(sum(prompt_tokens.values()), sum(sent_tok.values()))
            yield _sse(CompletionResponse(id=rid, created=created, model=srv.model_name, choices=[], usage=usage))
        yield "data: [DONE]\n\n"
    except EngineError as e:
        yield _error_event(e)
    finally:
        srv.async_engine.abort_stream(stream)


async def _stream_chat(srv: _Server, stream: OutputStream, rid: str, n: int, k: int | None,
                       include_usage: bool, decode: Callable[[int], str]) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
        return _sse(ChatCompletionChunk(id=rid, created=created, model=srv.model_name, choices=choices,
                                        usage=usage))

    sent_text = [0] * n
    sent_tok = [0] * n
    done: set[int] = set()
    prompt_tokens = 0
    try:
        yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                     for i in range(n)])
        async for out in stream:
            prompt_tokens = len(out.prompt_token_ids)
            for c in out.outputs:
                i = c.index
                if i in done:
                    continue
                delta = c.text[sent_text[i]:]
                if not delta and not c.finished:
                    continue
                lp = _chat_logprobs(c, sent_tok[i], len(c.token_ids), k, decode) if k is not None else None
                sent_text[i], sent_tok[i] = len(c.text), len(c.token_ids)
                if c.finished:
                    done.add(i)
                yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(content=delta), logprobs=lp,
                                             finish_reason=c.finish_reason)])
        if include_usage:
            yield chunk([], _usage(prompt_tokens, sum(sent_tok)))
        yield "data: [DONE]\n\n"
    except EngineError as e:
        yield _error_event(e)
    finally:
        srv.async_engine.abort_stream(stream)
