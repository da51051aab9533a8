"""Response shaping for the OpenAI app: OpenAI-shaped logprobs and usage, server-sent events, and
the streamed ``/v1/completions`` and ``/v1/chat/completions`` bodies.

A stream yields only new text per choice, ends with ``data: [DONE]``, turns an engine failure into
a final error event, and aborts its requests when it stops early (the client went away).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel

from pagedllm.outputs import CompletionOutput
from pagedllm.server.async_engine import EngineError, OutputStream
from pagedllm.server.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogProbs,
    CompletionResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    TopLogprob,
    UsageInfo,
)
from pagedllm.server.serving import _Server

LOGPROB_FLOOR = -9999.0  # JSON has no -inf


def _sse(obj: BaseModel | dict[str, Any]) -> str:
    data = obj.model_dump_json() if isinstance(obj, BaseModel) else json.dumps(obj)
    return f"data: {data}\n\n"


def _lp(v: float) -> float:
    return v if v == v and v > LOGPROB_FLOOR else LOGPROB_FLOOR


def _ranked(pos: dict[int, Any], k: int) -> list[tuple[int, Any]]:
    """The (token id, Logprob) pairs of rank 1..k, best first."""
    return sorted(((t, x) for t, x in pos.items() if x.rank is not None and x.rank <= k),
                  key=lambda i: i[1].rank)


def _token_text(tid: int, x: Any) -> str:
    """A Logprob's text (the engine always fills ``decoded_token``; a placeholder otherwise —
    the tokenizer is only used on the engine thread)."""
    return x.decoded_token if x is not None and x.decoded_token is not None else f"<token {tid}>"


def _completion_logprobs(c: CompletionOutput, start: int, end: int, k: int,
                         offset: int) -> CompletionLogProbs | None:
    if c.logprobs is None:
        return None
    out = CompletionLogProbs()
    for tid, pos in zip(c.token_ids[start:end], c.logprobs[start:end]):
        chosen = pos.get(tid)
        tok = _token_text(tid, chosen)
        out.tokens.append(tok)
        out.token_logprobs.append(_lp(chosen.logprob) if chosen is not None else None)
        out.top_logprobs.append({(x.decoded_token or _token_text(t, None)): _lp(x.logprob)
                                 for t, x in _ranked(pos, k)})
        out.text_offset.append(offset)
        offset += len(tok)
    return out


def _chat_logprobs(c: CompletionOutput, start: int, end: int, k: int) -> ChatLogprobs | None:
    if c.logprobs is None:
        return None
    content = []
    for tid, pos in zip(c.token_ids[start:end], c.logprobs[start:end]):
        chosen = pos.get(tid)
        tok = _token_text(tid, chosen)
        top = [TopLogprob(token=x.decoded_token or "", logprob=_lp(x.logprob),
                          bytes=list((x.decoded_token or "").encode()))
               for _, x in _ranked(pos, k)]
        content.append(ChatTokenLogprob(token=tok, logprob=_lp(chosen.logprob) if chosen else LOGPROB_FLOOR,
                                        bytes=list(tok.encode()), top_logprobs=top))
    return ChatLogprobs(content=content)


def _usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _error_event(e: BaseException) -> str:
    body = ErrorResponse(error=ErrorInfo(message=str(e), type="server_error", code="engine_error"))
    return _sse(body) + "data: [DONE]\n\n"


async def _stream_completion(srv: _Server, stream: OutputStream, rid: str, index_of: dict[str, int], n: int,
                             echo: list[str] | None, logprobs: int | None, include_usage: bool) -> AsyncIterator[str]:
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
                    lp = _completion_logprobs(c, k0, len(c.token_ids), logprobs, t0)
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
                       include_usage: bool) -> AsyncIterator[str]:
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
                lp = _chat_logprobs(c, sent_tok[i], len(c.token_ids), k) if k is not None else None
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
