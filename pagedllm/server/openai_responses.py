"""OpenAI's Responses API (``POST /v1/responses``) on top of the chat path.

A request becomes a chat completion request (``chat_body``): ``instructions`` a system message,
``input`` (a string, or items: messages, ``function_call`` and ``function_call_output``) the
conversation, flat function ``tools`` the chat shape, ``text.format`` a ``response_format``,
``max_output_tokens`` ``max_completion_tokens``. The chat path then checks, renders and runs it,
so the same prompt and sampling give the same tokens as ``/v1/chat/completions``. A 400 from
that path names the Responses field (``input``, not ``messages``).

Nothing is stored: ``store`` is answered ``false``, ``previous_response_id`` and ``background``
are 400s. Fields that change nothing here (``metadata``, ``user``, ``service_tier``,
``reasoning``, ``include`` of nothing, ``truncation: "disabled"``) are accepted and echoed.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.outputs import RequestOutput
from pagedllm.server.protocol import StrictModel
from pagedllm.server.serving import APIError
from pagedllm.server.tools import ToolPlan, parse_tool_calls

# a chat field's Responses name, for the 400s of the chat path
PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens",
          "response_format": "text", "max_tokens": "max_output_tokens"}
_PASSED = ("model", "temperature", "top_p", "parallel_tool_calls", "user", "seed", "top_k",
           "min_p", "repetition_penalty", "stop", "min_tokens", "ignore_eos", "request_id",
           "priority")  # the same field in a chat request (the last seven are vLLM's)


class ResponsesRequest(StrictModel):
    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra={"examples": [
        {"input": "Write a haiku about paged memory.", "max_output_tokens": 32}]})

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    stream: bool | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = Field(default=None, max_length=0)
    service_tier: str | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=0)  # no logprobs here yet
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    request_id: str | None = None
    priority: int | None = None


class ResponseObject(BaseModel):
    """OpenAI's Response object, for the OpenAPI document (``ResponseShape`` fills it)."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None = None


class ResponseStreamEvent(BaseModel):
    """One streamed event (``event: <type>``), for the OpenAPI document."""

    model_config = ConfigDict(extra="allow")

    type: str
    sequence_number: int


def chat_body(req: ResponsesRequest) -> dict[str, Any]:
    """The chat completion request ``req`` stands for (module docstring); 400s name its fields."""
    if req.previous_response_id is not None:
        raise APIError(400, "previous_response_id: this server stores no responses; send the "
                       "conversation in input", param="previous_response_id")
    if req.background:
        raise APIError(400, "background responses are not supported", param="background")
    body: dict[str, Any] = {k: getattr(req, k) for k in _PASSED if getattr(req, k) is not None}
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
    else:
        messages += _messages(req.input)
    body["messages"] = messages
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    if req.tools:
        body["tools"] = [_tool(t, i) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = _tool_choice(req.tool_choice)
    if req.text is not None and req.text.get("format") is not None:
        body["response_format"] = _format(req.text["format"])
    return body


def _messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"input[{i}].role {role!r}: use user, system, developer or "
                               "assistant", param="input")
            out.append({"role": role, "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function", "function": {
                "name": item.get("name"), "arguments": item.get("arguments")}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)  # parallel calls: one assistant message
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else _text(output, i)})
        else:
            raise APIError(400, f"input[{i}]: items of type {kind!r} are not supported (message, "
                           "function_call, function_call_output)", param="input")
    return out


def _text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text"):
                kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                raise APIError(400, f"input[{i}].content: parts of type {kind!r} are not "
                               "supported (input_text, output_text)", param="input")
            parts.append(str(p.get("text", "")))
        return "".join(parts)
    raise APIError(400, f"input[{i}].content: give a string or a list of text parts", param="input")


def _tool(t: dict[str, Any], i: int) -> dict[str, Any]:
    if t.get("type") != "function":
        raise APIError(400, f"tools[{i}]: only function tools are supported, not "
                       f"{t.get('type')!r}", param="tools")
    fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
    return {"type": "function", "function": fn}


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice  # "auto", "none", "required" (anything else: the chat path's 400)


def _format(fmt: Any) -> dict[str, Any]:
    if not isinstance(fmt, dict):
        raise APIError(400, "text.format: give an object with a type", param="text")
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return {"type": fmt.get("type")}  # text, json_object (anything else: the chat path's 400)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [text_part(text)] if status == "completed" else []}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call_id: str, name: str, arguments: str,
              status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_items(plan: ToolPlan | None, text: str) -> list[dict[str, Any]]:
    """A finished output's items: its text as a message, its tool calls as function calls."""
    content, calls = (text, []) if plan is None else parse_tool_calls(plan, text)
    items = [message_item(new_id("msg"), content or "")] if content or not calls else []
    return items + [call_item(new_id("fc"), c.id, c.function.name, c.function.arguments)
                    for c in calls]


class ResponseShape:
    """The Response object of one request, in progress or done (OpenAI's fields)."""

    def __init__(self, req: ResponsesRequest, rid: str, model: str) -> None:
        self.req, self.rid, self.model, self.created = req, rid, model, int(time.time())

    def __call__(self, status: str, output: list[dict[str, Any]],
                 out: RequestOutput | None = None, n_out: int | None = None) -> dict[str, Any]:
        """``out``: the request's final output (its usage; ``n_out``: its output tokens, when
        ``out`` is a stream's last delta)."""
        req = self.req
        usage = None
        if out is not None:
            n_in = len(out.prompt_token_ids)
            cached = out.metrics.num_cached_tokens if out.metrics is not None else 0
            n_out = len(out.outputs[0].token_ids) if n_out is None else n_out
            usage = {"input_tokens": n_in,
                     "input_tokens_details": {"cached_tokens": cached},
                     "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": n_in + n_out}
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.rid, "object": "response", "created_at": self.created,
                "status": status, "error": None, "incomplete_details": incomplete,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "model": self.model, "output": output,
                "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": None, "reasoning": req.reasoning,
                "store": False, "temperature": req.temperature, "top_p": req.top_p,
                "text": req.text or {"format": {"type": "text"}},
                "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
                "tools": req.tools or [], "truncation": "disabled", "usage": usage,
                "user": req.user, "metadata": req.metadata or {},
                "service_tier": req.service_tier}


def final_status(out: RequestOutput) -> str:
    return "incomplete" if out.outputs[0].finish_reason == "length" else "completed"
