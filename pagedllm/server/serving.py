"""Request handling for the OpenAI app: everything between a raw request and the engine.

``ServerLimits`` and ``APIError`` (an OpenAI-shaped refusal); reading a body by hand (size limit,
strict UTF-8, strict JSON, no lone surrogates) and validating it against ``protocol``'s strict
models; ``ServerState``, the per-app state that checks auth and model name, turns request fields into
``SamplingParams``, submits to the ``EngineClient`` and collects a non-streamed answer (aborting if
the client goes away); ``engine_failure``, what a client is told when the engine fails. The
prompt sources, which tokenize and check length on the client's tokenizer thread, are in
``prompts``.
"""

from __future__ import annotations

import asyncio
import email.message
import hmac
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from pagedllm.checks import lone_surrogate
from pagedllm.config import EngineConfig, default_model_path
from pagedllm.engine.client import (
    EngineClient,
    EngineError,
    EngineUnavailable,
    OutputStream,
    PromptSource,
    ServerShuttingDown,
)
from pagedllm.logging_utils import init_logger
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from pagedllm.server.args import ServerArgs
from pagedllm.server.lora import ServedAdapters
from pagedllm.server.metrics import ServerMetrics
from pagedllm.server.protocol import ErrorInfo, ErrorResponse, SamplingFields

logger = init_logger(__name__)

DEFAULT_MODEL_NAME = "default_model"  # the shipped model's name in the API (never its path)
MAX_SEED = 2**63 - 1024  # room for seed + i over n samples inside torch's int64 range


@dataclass(frozen=True)
class ServerLimits:
    """Per-request limits; anything above is a 400 naming the field."""

    max_request_bytes: int = ServerArgs.max_request_bytes
    max_n: int = ServerArgs.max_n
    max_tokens: int | None = ServerArgs.max_tokens_limit  # None: max_model_len
    max_prompt_tokens: int | None = ServerArgs.max_prompt_tokens  # None: max_model_len - 1
    max_prompts: int = ServerArgs.max_prompts  # prompts in one /v1/completions batch
    # logprobs, top_logprobs, prompt_logprobs: the engine's --max-logprobs (EngineConfig)
    max_logprobs: int = EngineConfig.max_logprobs

    @classmethod
    def from_args(cls, a: ServerArgs, max_logprobs: int = EngineConfig.max_logprobs
                  ) -> ServerLimits:
        return cls(a.max_request_bytes, a.max_n, a.max_tokens_limit, a.max_prompt_tokens,
                   a.max_prompts, max_logprobs)


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code))
        return JSONResponse(body.model_dump(), status_code=self.status)


class ClientGone(Exception):
    pass


class FieldError(ValueError):
    """A refusal found while preparing a prompt that names its request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def served_model_name(model: str) -> str:
    """The API name of a model by default: the path as given, ``default_model`` for the shipped one."""
    return DEFAULT_MODEL_NAME if Path(model).resolve() == Path(default_model_path()) else model


def engine_failure(e: BaseException, request_id: str) -> APIError:
    """What a client is told when the engine could not finish its request: what kind of failure
    and its request id, never the exception (paths, PIDs, hosts stay in the server log)."""
    if isinstance(e, ServerShuttingDown):
        return APIError(503, f"the server is shutting down and could not finish this request in "
                        f"time (request id {request_id}); retry it", type="server_error",
                        code="server_shutting_down")
    if isinstance(e, EngineUnavailable):
        return APIError(503, f"the engine is not running (request id {request_id}); the server log "
                        f"has the details", type="server_error", code="engine_unavailable")
    return APIError(500, f"the engine failed while running this request (request id {request_id}); "
                    f"the server log has the details", type="server_error", code="engine_error")


M = TypeVar("M", bound=BaseModel)


# -- request parsing -----------------------------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _check_json_content_type(request: Request) -> None:
    """A body is JSON only when it says so (``application/json`` or ``application/*+json``):
    ``text/plain``, form data and a body with no type are what a web page may send cross-site
    without a CORS preflight, so taking them would let any page drive a server that runs
    without --api-key. A 415, as FastAPI answers for the bodies it reads itself."""
    value = request.headers.get("content-type", "")
    msg = email.message.Message()
    msg["content-type"] = value
    sub = msg.get_content_subtype()
    if value and msg.get_content_maintype() == "application" and (sub == "json" or sub.endswith("+json")):
        return
    got = f"Content-Type {value!r}" if value else "no Content-Type"
    raise APIError(415, f"the request body must be JSON sent with 'Content-Type: application/json' "
                   f"(got {got})", param="body", code="unsupported_media_type")


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    _check_json_content_type(request)
    cl = request.headers.get("content-length")
    if cl is not None and cl.isdigit() and int(cl) > limit:
        raise APIError(413, f"the request body has {cl} bytes; the limit is {limit} (--max-request-bytes)",
                       param="body", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body exceeds {limit} bytes (--max-request-bytes)",
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
    for path, text in _strings(obj, ()):
        where = lone_surrogate(text)
        if where is not None:  # JSON's \ud800 escapes decode to text no tokenizer can encode
            name = ".".join(path) or "body"
            raise APIError(400, f"{name} contains a lone UTF-16 surrogate ({where}); send valid "
                           f"Unicode text", param=path[0] if path else "body", code="invalid_encoding")
    return obj


def _strings(obj: Any, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], str]]:
    """Every string in a parsed JSON value (keys too), with where it is."""
    stack = [(path, obj)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, str):
            yield where, v
        elif isinstance(v, dict):
            for k, x in v.items():
                yield (*where, k), k
                stack.append(((*where, k), x))
        elif isinstance(v, list):
            stack.extend(((*where, str(i)), x) for i, x in enumerate(v))


def validate_body(model: type[M], body: dict[str, Any]) -> M:
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
    m = re.match(r"([a-z_]+)(=|\[| )", message)
    return m.group(1) if m else None


def _nonfinite(name: str, value: float | None) -> None:
    if value is not None and not math.isfinite(value):
        raise APIError(400, f"{name}={value} is invalid; give a finite number", param=name)


# -- app ------------------------------------------------------------------------------------------


class ServerState:
    """Request handling state for one app (engine client, limits, names)."""

    def __init__(self, client: EngineClient, model_name: str, api_key: str | None,
                 limits: ServerLimits) -> None:
        self.model_name = model_name
        self.aliases = {model_name, Path(model_name).name}
        self.api_key = api_key
        self.limits = limits
        self.max_model_len = client.config.scheduler.max_model_len
        self.vocab_size = client.config.model.vocab_size
        self.metrics = ServerMetrics(client, model_name)
        self.adapters = ServedAdapters(client, self.aliases)  # LoRA: model: <adapter>
        client.stats_listeners.append(self.metrics.on_step)
        self.async_engine = client
        self.scaling = False  # a /scale_elastic_ep call is running

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
        if name is not None and name not in self.aliases and self.adapters.lora_of(name) is None:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def sampling_params(self, req: SamplingFields, max_tokens: int | None, max_tokens_field: str,
                        logprobs: int | None, logprobs_field: str,
                        structured: StructuredOutputsParams | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """``prompt_logprobs``: what the endpoint needs of the prompt besides the request's own
        ``prompt_logprobs`` (an echo's logprobs); the engine computes the larger."""
        lim = self.limits
        if req.n > lim.max_n:
            raise APIError(400, f"n={req.n} exceeds this server's limit of {lim.max_n} (--max-n)", param="n")
        cap = min(lim.max_tokens or self.max_model_len, self.max_model_len)
        if max_tokens is not None and max_tokens > cap:
            raise APIError(400, f"{max_tokens_field}={max_tokens} exceeds this server's limit of {cap}",
                           param=max_tokens_field)
        if max_tokens is None and lim.max_tokens is not None:
            max_tokens = cap
        for name, k in ((logprobs_field, logprobs), ("prompt_logprobs", req.prompt_logprobs)):
            if k is not None and k > lim.max_logprobs:
                raise APIError(400, f"{name}={k} exceeds this server's limit of {lim.max_logprobs} "
                               f"(--max-logprobs)", param=name)
        if req.seed is not None and not 0 <= req.seed <= MAX_SEED:
            raise APIError(400, f"seed={req.seed} is invalid; must be in [0, {MAX_SEED}]", param="seed")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            _nonfinite(name, getattr(req, name))
        # what the request leaves out: the model's generation_config defaults (--generation-config)
        sampling = self.async_engine.frontend.generation_defaults.merge(
            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
            repetition_penalty=req.repetition_penalty)
        if sampling.get("top_k", 0) >= self.vocab_size:
            sampling["top_k"] = 0  # keeping the whole vocabulary is no top-k at all
        kwargs: dict[str, Any] = dict(
            **sampling,
            n=req.n,
            seed=req.seed,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=max((k for k in (req.prompt_logprobs, prompt_logprobs) if k is not None),
                                default=None),
            logit_bias=req.logit_bias or None,
            allowed_token_ids=req.allowed_token_ids,
            bad_words=req.bad_words or None,
            structured_outputs=structured,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            output_kind=RequestOutputKind.DELTA,  # streamed as they come, or added up by collect
        )
        try:
            return SamplingParams(**kwargs)
        except ValueError as e:
            param = _field_of(str(e))
            msg = str(e)
            if param == "max_tokens" and max_tokens_field != "max_tokens":
                param = max_tokens_field
                msg = msg.replace("max_tokens=", f"{max_tokens_field}=", 1)
            if param == "logprobs":
                param = logprobs_field
                msg = msg.replace("logprobs=", f"{logprobs_field}=", 1)
            raise APIError(400, msg, param=param if param in type(req).model_fields else None) from None

    async def check_grammar(self, so: StructuredOutputsParams | None, field: str | None) -> None:
        """Compile the request's grammar off the engine thread (a large schema takes a while;
        the engine then finds it cached): a grammar that does not compile is a 400 naming
        ``field``."""
        if so is None:
            return
        from pagedllm.structured import GrammarError

        try:
            await asyncio.to_thread(self.async_engine.frontend.compiler.compile, so)
        except GrammarError as e:
            where = field if field != "structured_outputs" else f"structured_outputs.{e.field}"
            raise APIError(400, f"{where}: {e.problem}", param=field,
                           code="invalid_grammar") from None

    # -- submission --------------------------------------------------------------------------------
    async def submit(self, base_id: str, prompts: list[PromptSource], params: SamplingParams,
                     req: SamplingFields, param: str) -> tuple[OutputStream, list[str]]:
        """Queue one engine request per prompt (``base_id-i``). A refusal is a 400 naming the
        field (``param``, the prompt's, unless the engine's message names a request field)."""
        stream = OutputStream()
        ids: list[str] = []
        lora = self.adapters.lora_of(req.model)
        try:
            for i, p in enumerate(prompts):
                rid = f"{base_id}-{i}"
                await self.async_engine.add_request(rid, p, params, stream, req.priority, lora)
                ids.append(rid)
        except ValueError as e:
            self.async_engine.abort_stream(stream)
            named = getattr(e, "param", None) or _field_of(str(e))
            field = named if named in type(req).model_fields else param
            raise APIError(400, str(e), param=field, code="invalid_prompt") from None
        except EngineError as e:
            self.async_engine.abort_stream(stream)
            logger.warning("request %s refused: %s", base_id, e)
            raise engine_failure(e, base_id) from None
        except Exception:
            self.async_engine.abort_stream(stream)
            logger.exception("request %s failed while it was prepared", base_id)
            raise engine_failure(EngineError("preparation failed"), base_id) from None
        except BaseException:
            self.async_engine.abort_stream(stream)
            raise
        self.metrics.count_lora(lora, len(ids))
        return stream, ids

    async def collect(self, request: Request, stream: OutputStream, base_id: str) -> dict[str, RequestOutput]:
        """Wait for the final outputs (the deltas added up); abort everything if the client
        disconnects first. An engine failure, or a request the engine ended with
        finish_reason "error", is a 5xx naming ``base_id`` only."""
        final: dict[str, RequestOutput] = {}

        async def consume() -> None:
            async for out in stream:
                acc = final.get(out.request_id)
                if acc is None:
                    final[out.request_id] = acc = RequestOutput(
                        out.request_id, out.prompt, out.prompt_token_ids, None, [], False)
                acc.add(out)

        consumer = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if consumer in done:
                try:
                    consumer.result()
                except EngineError as e:
                    raise engine_failure(e, base_id) from None
                if any(c.finish_reason == "error" for out in final.values() for c in out.outputs):
                    raise engine_failure(EngineError("a request failed in a step"), base_id)
                return final
            raise ClientGone()
        finally:
            watcher.cancel()
            consumer.cancel()
            self.async_engine.abort_stream(stream)


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
