"""Response shaping for the OpenAI app: OpenAI-shaped logprobs and usage, server-sent events, and
the streamed ``/v1/completions`` and ``/v1/chat/completions`` bodies: one delta loop
(``stream_deltas``) over the engine's DELTA outputs, shaped per endpoint (``CompletionChunks``,
``ChatChunks``).

A stream yields only new text per choice, ends with ``data: [DONE]``, turns an engine failure (or
a request the engine ended with finish_reason "error") into a final error event before
``[DONE]``, and aborts its requests when it stops early (the client went away).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel

from pagedllm.engine.client import EngineError, OutputStream
from pagedllm.outputs import CompletionOutput, RequestOutput
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
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
    UsageInfo,
)
from pagedllm.server.serving import APIError, ServerState, engine_failure
from pagedllm.server.tools import ToolPlan, ToolStream, tool_finish_reason

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


def _token_text(tid: int, x: Any, as_ids: bool = False) -> str:
    """A Logprob's text (the engine always fills ``decoded_token``; a placeholder otherwise —
    the tokenizer is only used on the engine thread); ``as_ids``: vLLM's
    ``return_tokens_as_token_ids``, ``token_id:<id>``."""
    if as_ids:
        return f"token_id:{tid}"
    return x.decoded_token if x is not None and x.decoded_token is not None else f"<token {tid}>"


def _top_text(tid: int, x: Any, as_ids: bool) -> str:
    return _token_text(tid, None, as_ids) if as_ids or not x.decoded_token else str(x.decoded_token)


def _add_position(lp: CompletionLogProbs, tid: int, pos: dict[int, Any] | None, k: int,
                  offset: int, as_ids: bool) -> int:
    """One token of OpenAI's completion logprobs; the offset of the next."""
    chosen = pos.get(tid) if pos is not None else None
    tok = _token_text(tid, chosen, as_ids)
    lp.tokens.append(tok)
    lp.token_logprobs.append(_lp(chosen.logprob) if chosen is not None else None)
    lp.top_logprobs.append(None if pos is None else {
        _top_text(t, x, as_ids): _lp(x.logprob) for t, x in _ranked(pos, k)})
    lp.text_offset.append(offset)
    return offset + len(tok)


def completion_logprobs(c: CompletionOutput, start: int, end: int, k: int,
                        offset: int, as_ids: bool = False) -> CompletionLogProbs | None:
    if c.logprobs is None:
        return None
    out = CompletionLogProbs()
    for tid, pos in zip(c.token_ids[start:end], c.logprobs[start:end]):
        offset = _add_position(out, tid, pos, k, offset, as_ids)
    return out


def echo_logprobs(out: RequestOutput, first_token: str, k: int,
                  generated: CompletionOutput | None, as_ids: bool = False) -> CompletionLogProbs:
    """OpenAI's logprobs of an echoed prompt (``echo`` with ``logprobs``), from the engine's
    prompt logprobs: the prompt's tokens, the first with null logprobs (nothing precedes it),
    then the ``generated`` tokens, if any; ``text_offset`` counts characters of the echo."""
    if as_ids:
        first_token = _token_text(out.prompt_token_ids[0], None, as_ids)
    lp = CompletionLogProbs(tokens=[first_token], token_logprobs=[None], top_logprobs=[None],
                            text_offset=[0])
    offset = len(first_token)
    positions = out.prompt_logprobs or []
    for tid, pos in zip(out.prompt_token_ids[1:], positions[1:]):
        offset = _add_position(lp, tid, pos, k, offset, as_ids)
    if generated is not None and generated.logprobs is not None:
        for tid, pos in zip(generated.token_ids, generated.logprobs):
            offset = _add_position(lp, tid, pos, k, offset, as_ids)
    return lp


def chat_logprobs(c: CompletionOutput, start: int, end: int, k: int,
                  as_ids: bool = False) -> ChatLogprobs | None:
    if c.logprobs is None:
        return None
    content = []
    for tid, pos in zip(c.token_ids[start:end], c.logprobs[start:end]):
        chosen = pos.get(tid)
        tok = _token_text(tid, chosen, as_ids)
        tops = [(_token_text(t, x, True) if as_ids else x.decoded_token or "", x)
                for t, x in _ranked(pos, k)]
        top = [TopLogprob(token=t, logprob=_lp(x.logprob), bytes=list(t.encode())) for t, x in tops]
        content.append(ChatTokenLogprob(token=tok, logprob=_lp(chosen.logprob) if chosen else LOGPROB_FLOOR,
                                        bytes=list(tok.encode()), top_logprobs=top))
    return ChatLogprobs(content=content)


def vllm_prompt_logprobs(out: RequestOutput, k: int | None = None) -> PromptLogprobs | None:
    """vLLM's ``prompt_logprobs``: per prompt position, token id -> logprob, rank, text (with
    ``k``: the prompt's token and those of rank <= k, when the engine was asked for more)."""
    if out.prompt_logprobs is None:
        return None
    return [None if pos is None else {
        str(t): PromptLogprob(logprob=_lp(x.logprob), rank=x.rank, decoded_token=x.decoded_token)
        for t, x in pos.items()
        if k is None or t == tid or (x.rank is not None and x.rank <= k)}
        for tid, pos in zip(out.prompt_token_ids, out.prompt_logprobs)]


def usage_info(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _error_event(e: APIError) -> str:
    body = ErrorResponse(error=ErrorInfo(message=e.message, type=e.type, param=e.param, code=e.code))
    return _sse(body) + "data: [DONE]\n\n"


class _Chunks:
    """How one endpoint shapes a stream: the chunks before the first delta, one chunk per delta
    of a choice (``offset``: characters of that choice sent before; ``first``: its first
    chunk), and the usage chunk. ``model``: the name in each chunk (a LoRA adapter's, else the
    served model's)."""

    def __init__(self, srv: ServerState, rid: str, model: str | None = None) -> None:
        self.srv, self.rid, self.created = srv, rid, int(time.time())
        self.model = model or srv.model_name

    def head(self) -> list[BaseModel]:
        return []

    def choice(self, out: RequestOutput, c: CompletionOutput, offset: int,
               first: bool, usage: UsageInfo | None = None) -> BaseModel:
        raise NotImplementedError

    def usage(self, usage: UsageInfo) -> BaseModel:
        raise NotImplementedError


class CompletionChunks(_Chunks):
    def __init__(self, srv: ServerState, rid: str, index_of: dict[str, int], n: int,
                 echo: list[str] | None, logprobs: int | None, as_ids: bool = False,
                 model: str | None = None) -> None:
        super().__init__(srv, rid, model)
        self.index_of, self.n, self.echo, self.logprobs = index_of, n, echo, logprobs
        self.as_ids = as_ids

    def _response(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> BaseModel:
        return CompletionResponse(id=self.rid, created=self.created, model=self.model,
                                  choices=choices, usage=usage)

    def choice(self, out: RequestOutput, c: CompletionOutput, offset: int,
               first: bool, usage: UsageInfo | None = None) -> BaseModel:
        p = self.index_of[out.request_id]
        text = c.text
        if first and self.echo is not None:
            text = self.echo[p] + text
        lp = None
        if self.logprobs is not None:
            lp = completion_logprobs(c, 0, len(c.token_ids), self.logprobs, offset, self.as_ids)
        return self._response([CompletionChoice(index=p * self.n + c.index, text=text, logprobs=lp,
                                                finish_reason=c.finish_reason,
                                                stop_reason=c.stop_reason)], usage)

    def usage(self, usage: UsageInfo) -> BaseModel:
        return self._response([], usage)


class ChatChunks(_Chunks):
    """``plan``: the request's tool calling (``server.tools``), read from each choice's text."""

    def __init__(self, srv: ServerState, rid: str, n: int, k: int | None,
                 plan: ToolPlan | None = None, as_ids: bool = False,
                 model: str | None = None) -> None:
        super().__init__(srv, rid, model)
        self.n, self.k, self.plan, self.as_ids = n, k, plan, as_ids
        self.tools: dict[int, ToolStream] = {}

    def _chunk(self, choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> BaseModel:
        return ChatCompletionChunk(id=self.rid, created=self.created, model=self.model,
                                   choices=choices, usage=usage)

    def head(self) -> list[BaseModel]:
        return [self._chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                             for i in range(self.n)])]

    def choice(self, out: RequestOutput, c: CompletionOutput, offset: int,
               first: bool, usage: UsageInfo | None = None) -> BaseModel:
        lp = (chat_logprobs(c, 0, len(c.token_ids), self.k, self.as_ids) if self.k is not None
              else None)
        if self.plan is None:
            delta, reason = DeltaMessage(content=c.text), c.finish_reason
        else:
            ts = self.tools.setdefault(c.index, ToolStream(self.plan))
            content, calls = ts.feed(c.text, c.finish_reason is not None)
            delta = DeltaMessage(content=content, tool_calls=calls)
            reason = tool_finish_reason(self.plan, c.finish_reason, [None] * ts.calls)
        return self._chunk([ChatChunkChoice(index=c.index, delta=delta, logprobs=lp,
                                            finish_reason=reason)], usage)

    def usage(self, usage: UsageInfo) -> BaseModel:
        return self._chunk([], usage)


async def stream_deltas(srv: ServerState, stream: OutputStream, chunks: _Chunks,
                        include_usage: bool, continuous_usage: bool = False) -> AsyncIterator[str]:
    """The SSE body of a streamed request, from the engine's DELTA outputs: each delta of a
    choice is one chunk (with the usage so far, with ``continuous_usage``), then the usage (if
    asked), then ``[DONE]``."""
    sent: dict[tuple[str, int], int] = {}  # (request, choice) -> characters sent
    prompt_tokens: dict[str, int] = {}
    completion_tokens = 0
    try:
        for head in chunks.head():
            yield _sse(head)
        async for out in stream:
            prompt_tokens[out.request_id] = len(out.prompt_token_ids)
            if any(c.finish_reason == "error" for c in out.outputs):
                yield _error_event(engine_failure(EngineError("a request failed in a step"), chunks.rid))
                return
            for c in out.outputs:
                key = (out.request_id, c.index)
                offset = sent.get(key)
                completion_tokens += len(c.token_ids)
                usage = (usage_info(sum(prompt_tokens.values()), completion_tokens)
                         if continuous_usage else None)
                yield _sse(chunks.choice(out, c, offset or 0, offset is None, usage))
                sent[key] = (offset or 0) + len(c.text)
        if include_usage:
            yield _sse(chunks.usage(usage_info(sum(prompt_tokens.values()), completion_tokens)))
        yield "data: [DONE]\n\n"
    except EngineError as e:
        yield _error_event(engine_failure(e, chunks.rid))
    finally:
        srv.async_engine.abort_stream(stream)
