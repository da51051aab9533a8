"""Tool calling on chat completions: ``tools`` / ``tool_choice`` -> what the prompt shows, how the
output is constrained, and how it is read back as OpenAI ``tool_calls``.

- ``none``: the tools reach the chat template, the output is plain text.
- ``auto`` (the default when tools are sent): the model decides; its text is read by the parser
  the server was started with (``--tool-call-parser``, ``pagedllm.choices.TOOL_CALL_PARSERS``);
  text that holds no call stays content.
- ``required``: the output is constrained (structured outputs) to a JSON array of at least one
  ``{"name": <a tool>, "parameters": <its arguments>}``, vLLM's form (exactly one with
  ``parallel_tool_calls: false``).
- a named function: the output is constrained to that function's ``parameters`` schema and is
  its arguments.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pagedllm.choices import TOOL_CALL_PARSERS
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.server.protocol import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from pagedllm.server.serving import APIError

_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
_PYTHON_TAG = "<|python_tag|>"
_ANY_PARAMETERS: dict[str, Any] = {"type": "object"}
# response-message keys a client may send back in the history, accepted when empty
_NULL_OK = frozenset({"refusal", "annotations", "audio", "function_call", "reasoning_content"})


@dataclass
class ToolPlan:
    """One request's tool calling: ``mode`` none / auto / required / named, the tools in the
    chat template's form, the output constraint (required, named) and the parser (auto)."""

    mode: str
    tools: list[dict[str, Any]]
    constraint: StructuredOutputsParams | None = None
    name: str | None = None  # named: the function
    parser: str | None = None  # auto


def tool_plan(req: ChatCompletionRequest, parser: str | None) -> ToolPlan | None:
    """None when the request sends no tools. 400s name ``tools`` or ``tool_choice``."""
    if not req.tools:
        if req.tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    names = [t.function.name for t in req.tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tools have duplicate function names", param="tools")
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    if isinstance(choice, str):
        if choice == "none":
            return ToolPlan("none", tools)
        if choice == "auto":
            if parser is None:
                raise APIError(400, "tool_choice 'auto' needs a tool-call parser: start the server "
                               f"with --tool-call-parser ({' or '.join(TOOL_CALL_PARSERS)}), or send "
                               "tool_choice 'none', 'required' or a named function",
                               param="tool_choice")
            return ToolPlan("auto", tools, parser=parser)
        if choice == "required":
            items = [{"type": "object", "required": ["name", "parameters"], "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": t.function.parameters or _ANY_PARAMETERS}} for t in req.tools]
            schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                      "items": items[0] if len(items) == 1 else {"anyOf": items}}
            if not req.parallel_tool_calls:
                schema["maxItems"] = 1
            return ToolPlan("required", tools, StructuredOutputsParams(json=schema))
        raise APIError(400, f"tool_choice={choice!r}: send 'none', 'auto', 'required' or "
                       '{"type": "function", "function": {"name": ...}}', param="tool_choice")
    fn = choice.get("function") if choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise APIError(400, 'a named tool_choice is {"type": "function", "function": {"name": '
                       "...}}", param="tool_choice")
    if name not in names:
        raise APIError(400, f"tool_choice names {name!r}, which is not among tools "
                       f"({', '.join(names)})", param="tool_choice")
    params = req.tools[names.index(name)].function.parameters or _ANY_PARAMETERS
    return ToolPlan("named", tools, StructuredOutputsParams(json=params), name=name)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments: Any) -> ToolCall:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=args))


def parse_tool_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a finished output. Output the parser cannot read stays content."""
    if plan.mode == "named":
        assert plan.name is not None
        return None, [_call(plan.name, text)]
    if plan.mode == "required":
        try:
            calls = json.loads(text)
            return None, [_call(c["name"], c["parameters"]) for c in calls]
        except (ValueError, TypeError, KeyError):  # cut short by max_tokens
            return text, []
    if plan.mode != "auto":
        return text, []
    return (_parse_hermes if plan.parser == "hermes" else _parse_llama3_json)(text)


def _named_objects(objs: list[Any]) -> list[ToolCall] | None:
    calls = []
    for obj in objs:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        calls.append(_call(obj["name"], obj.get("arguments", obj.get("parameters", {}))))
    return calls


def _parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen2.5)."""
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    try:
        calls = _named_objects([json.loads(m) for m in _HERMES.findall(text[start:])])
    except ValueError:
        return text, []
    if calls is None:
        return text, []
    return (text[:start] if text[:start].strip() else None), calls


def _parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    """Llama 3.x: the whole output is ``{"name": ..., "parameters": {...}}`` (several joined by
    ``;``), optionally after ``<|python_tag|>``."""
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].lstrip()
    if not body.startswith("{"):
        return text, []
    dec, objs, i = json.JSONDecoder(), [], 0
    try:
        while i < len(body):
            obj, i = dec.raw_decode(body, i)
            objs.append(obj)
            while i < len(body) and body[i] in " \n\t;":
                i += 1
    except ValueError:
        return text, []
    calls = _named_objects(objs)
    return (text, []) if calls is None else (None, calls)


def tool_finish_reason(plan: ToolPlan | None, finish_reason: str | None,
                       calls: list[Any]) -> str | None:
    """OpenAI's: "tool_calls" when the model chose to call (auto, required); a named choice and
    a cut-short output keep theirs."""
    if plan is None or not calls or plan.mode == "named" or finish_reason != "stop":
        return finish_reason
    return "tool_calls"


def messages_for_template(messages: list[Any]) -> list[dict[str, Any]]:
    """The history as chat templates take it: assistant ``tool_calls`` with their arguments as
    objects (HF templates iterate over them; vLLM passes them so), ``tool`` messages with their
    ``tool_call_id``."""
    out = []
    for i, m in enumerate(messages):
        for key, value in (m.model_extra or {}).items():
            if key not in _NULL_OK or value not in (None, [], ""):
                raise ValueError(f"messages[{i}].{key} is not supported; remove it")
        d: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            calls = []
            for c in m.tool_calls:
                try:
                    args = json.loads(c.function.arguments)
                except ValueError:
                    raise ValueError(f"tool call {c.id}'s function.arguments is not JSON") from None
                calls.append({"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": args}})
            d["tool_calls"] = calls
        out.append(d)
    return out


class ToolStream:
    """One streamed choice's text deltas -> (content delta, tool-call deltas). A named call
    streams its arguments as they come; ``required`` and ``auto`` hold the text of the calls back
    and send each call whole when the output ends (``auto`` streams the content before a call and
    holds back only what could be the start of one)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""  # all of the choice's text so far
        self.sent = 0  # characters of it sent as content
        self.in_call = plan.mode == "required"
        self.calls = 0  # tool calls sent
        self.call_at = 0  # where the first call's text begins (once in_call)

    def feed(self, delta: str, finished: bool) -> tuple[str | None, list[DeltaToolCall] | None]:
        plan = self.plan
        self.text += delta
        if plan.mode == "none":
            return delta, None
        if plan.mode == "named":
            assert plan.name is not None
            if self.calls == 0:
                self.calls = 1
                return None, [DeltaToolCall(index=0, id=new_call_id(), type="function",
                                            function=DeltaFunctionCall(name=plan.name,
                                                                       arguments=delta))]
            return None, [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta))]
        if not self.in_call:
            self._look_for_a_call()
        content = self._content(finished)
        if not finished or not self.in_call:
            return content, None
        rest, calls = parse_tool_calls(plan, self.text)
        if not calls:  # not a readable call after all: the text is content
            return (content or "") + self.text[self.sent:], None
        self.calls = len(calls)
        return content, [DeltaToolCall(index=i, id=c.id, type="function", function=DeltaFunctionCall(
            name=c.function.name, arguments=c.function.arguments)) for i, c in enumerate(calls)]

    def _look_for_a_call(self) -> None:
        if self.plan.parser == "hermes":
            at = self.text.find("<tool_call>", self.sent)
            if at >= 0:
                self.in_call, self.call_at = True, at
            return
        head = self.text.lstrip()  # llama3_json: the whole output is the call
        if head and (head.startswith("{") or head.startswith(_PYTHON_TAG)):
            self.in_call, self.call_at = True, 0

    def _content(self, finished: bool) -> str | None:
        """The content not yet sent that may go now."""
        if self.in_call:
            end = max(self.sent, self.call_at)
        elif finished:
            end = len(self.text)
        elif self.plan.parser == "hermes":
            end = len(self.text) - _held_back(self.text, "<tool_call>")
        else:
            head = self.text.lstrip()
            could_start = not head or _PYTHON_TAG.startswith(head[:len(_PYTHON_TAG)])
            end = self.sent if could_start and self.sent == 0 else len(self.text)
        out = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return out or None


def _held_back(text: str, marker: str) -> int:
    """Characters at the end of ``text`` that could begin ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
