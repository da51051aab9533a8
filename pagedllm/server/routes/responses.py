"""``POST /v1/responses``: OpenAI's Responses API over the chat path
(``server.openai_responses``), whole or streamed as its typed server-sent events."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedllm.engine.client import EngineError, OutputStream
from pagedllm.outputs import RequestOutput
from pagedllm.server.openai_responses import (
    PARAMS,
    ResponseObject,
    ResponseShape,
    ResponsesRequest,
    ResponseStreamEvent,
    call_item,
    chat_body,
    final_status,
    message_item,
    new_id,
    output_items,
    text_part,
)
from pagedllm.server.openapi import GENERATE, answers, request_body
from pagedllm.server.protocol import ChatCompletionRequest
from pagedllm.server.responses import SSE_HEADERS
from pagedllm.server.routes.chat import start_chat
from pagedllm.server.routes.common import AUTH, Options, State
from pagedllm.server.serving import (
    APIError,
    ClientGone,
    ServerState,
    engine_failure,
    read_json,
    validate_body,
)
from pagedllm.server.tools import ToolPlan, ToolStream

router = APIRouter(prefix="/v1", dependencies=AUTH)


@router.post("/responses", openapi_extra=request_body(ResponsesRequest),
             responses=answers(ResponseObject, *GENERATE, stream=ResponseStreamEvent,
                               stream_end="response.completed, response.incomplete or "
                               "response.failed last (no [DONE])"))
async def responses(request: Request, srv: State, options: Options) -> Response:
    req = validate_body(ResponsesRequest, await read_json(request, srv.limits.max_request_bytes))
    try:
        chat = validate_body(ChatCompletionRequest, chat_body(req))
        rid, stream, ids, plan, model, _ = await start_chat(srv, options, chat, "resp",
                                                            "/v1/responses")
    except APIError as e:  # name the Responses field
        e.param = PARAMS.get(e.param or "", e.param)
        raise
    if chat.request_id is None:  # OpenAI's shape of a fresh id; a client's own id stays as sent
        rid = "resp_" + rid.removeprefix("resp-")
    shape = ResponseShape(req, rid, model)
    if req.stream:
        return StreamingResponse(_events(srv, stream, shape, plan), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    try:
        final = await srv.collect(request, stream, rid)
    except ClientGone:
        return Response(status_code=499)
    out = final[ids[0]]
    return JSONResponse(shape(final_status(out), output_items(plan, out.outputs[0].text), out))


class _Events:
    """The typed events of one streamed response, numbered in order."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"


class _Output:
    """The output items of a streamed response as they open and close: one message (its text
    streamed as deltas), then a function call per tool call (its arguments as deltas)."""

    def __init__(self, ev: _Events) -> None:
        self.ev, self.text = ev, ""
        self.items: list[dict[str, Any]] = []
        self.msg: dict[str, Any] | None = None  # the open message
        self.calls: dict[int, dict[str, Any]] = {}  # tool call index -> its open item

    def text_delta(self, delta: str) -> list[str]:
        out = []
        if self.msg is None:
            self.msg = message_item(new_id("msg"), "", "in_progress")
            self.items.append(self.msg)
            out.append(self.ev("response.output_item.added", output_index=len(self.items) - 1,
                               item=self.msg))
            out.append(self.ev("response.content_part.added", **self._at(self.msg),
                               part=text_part("")))
        self.text += delta
        return out + [self.ev("response.output_text.delta", **self._at(self.msg), delta=delta,
                              logprobs=[])]

    def call_delta(self, index: int, call_id: str | None, name: str | None, args: str) -> list[str]:
        out = self.close_message()
        item = self.calls.get(index)
        if item is None:
            item = self.calls[index] = call_item(new_id("fc"), call_id or new_id("call"),
                                                 name or "", "", "in_progress")
            self.items.append(item)
            out.append(self.ev("response.output_item.added", output_index=len(self.items) - 1,
                               item=dict(item)))
        item["arguments"] += args
        return out + [self.ev("response.function_call_arguments.delta", item_id=item["id"],
                              output_index=self.items.index(item), delta=args)]

    def _at(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.items.index(item), "content_index": 0}

    def close_message(self) -> list[str]:
        if self.msg is None or self.msg["status"] == "completed":
            return []
        at, part = self._at(self.msg), text_part(self.text)
        self.msg.update(status="completed", content=[part])
        return [self.ev("response.output_text.done", **at, text=self.text, logprobs=[]),
                self.ev("response.content_part.done", **at, part=part),
                self.ev("response.output_item.done", output_index=at["output_index"],
                        item=self.msg)]

    def close(self) -> list[str]:
        out = self.close_message()
        for item in self.calls.values():
            item["status"] = "completed"
            at = self.items.index(item)
            out.append(self.ev("response.function_call_arguments.done", item_id=item["id"],
                               output_index=at, name=item["name"], arguments=item["arguments"]))
            out.append(self.ev("response.output_item.done", output_index=at, item=item))
        return out


async def _events(srv: ServerState, stream: OutputStream, shape: ResponseShape,
                  plan: ToolPlan | None) -> AsyncIterator[str]:
    ev = _Events()
    output = _Output(ev)
    tools = ToolStream(plan) if plan is not None else None
    last: RequestOutput | None = None
    n_out = 0
    try:
        yield ev("response.created", response=shape("in_progress", []))
        yield ev("response.in_progress", response=shape("in_progress", []))
        async for out in stream:
            c = out.outputs[0]
            if c.finish_reason == "error":
                raise EngineError("a request failed in a step")
            last, n_out = out, n_out + len(c.token_ids)
            content, calls = (c.text, None) if tools is None else tools.feed(
                c.text, c.finish_reason is not None)
            for line in output.text_delta(content) if content else []:
                yield line
            for d in calls or []:
                fn = d.function
                for line in output.call_delta(d.index, d.id, fn.name if fn else None,
                                              (fn.arguments or "") if fn else ""):
                    yield line
        for line in output.close():
            yield line
        assert last is not None
        status = final_status(last)
        yield ev(f"response.{status}", response=shape(status, output.items, last, n_out))
    except EngineError as e:
        err = engine_failure(e, shape.rid)
        failed = shape("failed", output.items)
        failed["error"] = {"code": err.code or "server_error", "message": err.message}
        yield ev("response.failed", response=failed)
    finally:
        srv.async_engine.abort_stream(stream)

