"""Tool-call parsing without a model: the hermes and llama3_json parsers, tool_choice plans, and
streamed deltas (the text cut at every character) reassembling to the non-streamed answer."""

from __future__ import annotations

import json
from typing import Any

import pytest
from structured_helpers import TOOLS

from pagedllm.server.protocol import ChatCompletionRequest
from pagedllm.server.serving import APIError
from pagedllm.server.tools import ToolPlan, ToolStream, parse_tool_calls, tool_plan

MSG = [{"role": "user", "content": "hi"}]


def _plan(choice: Any = None, parser: str | None = "hermes", tools: Any = TOOLS) -> ToolPlan:
    body: dict[str, Any] = {"messages": MSG, "tools": tools}
    if choice is not None:
        body["tool_choice"] = choice
    plan = tool_plan(ChatCompletionRequest.model_validate(body), parser)
    assert plan is not None
    return plan


def _calls(calls: list[Any]) -> list[tuple[str, Any]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


HERMES = [
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
     None, [("add", {"a": 1, "b": 2})]),
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": '
     '"celsius"}}\n</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}',
     "Let me check.\n", [("get_weather", {"city": "Oslo", "unit": "celsius"}), ("add", {"a": 3, "b": 4})]),
    ("no call here", "no call here", []),
    ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
]
LLAMA3 = [
    ('{"name": "add", "parameters": {"a": 1, "b": 2}}', None, [("add", {"a": 1, "b": 2})]),
    ('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "add", '
     '"parameters": {"a": 5, "b": 6}}', None, [("add", {"a": 1, "b": 2}), ("add", {"a": 5, "b": 6})]),
    ("The answer is 3.", "The answer is 3.", []),
    ('{"city": "Oslo"}', '{"city": "Oslo"}', []),  # JSON, but not a call
]


@pytest.mark.parametrize(("parser", "text", "content", "calls"),
                         [("hermes", *c) for c in HERMES] + [("llama3_json", *c) for c in LLAMA3])
def test_parsers_and_their_streams(parser: str, text: str, content: str | None,
                                   calls: list[tuple[str, Any]]) -> None:
    plan = _plan("auto", parser)
    got_content, got_calls = parse_tool_calls(plan, text)
    assert got_content == content and _calls(got_calls) == calls
    streamed_content, streamed_calls = _stream(plan, text)
    assert streamed_content == (content or "") if calls else streamed_content == text
    assert [(n, json.loads(a)) for n, a in streamed_calls] == calls


def _stream(plan: ToolPlan, text: str) -> tuple[str, list[tuple[str, str]]]:
    """Feed the text a character at a time; reassemble as an OpenAI client would."""
    ts = ToolStream(plan)
    content, calls = "", {}
    for i, ch in enumerate(text):
        c, deltas = ts.feed(ch, i == len(text) - 1)
        content += c or ""
        for d in deltas or []:
            slot = calls.setdefault(d.index, ["", ""])
            slot[0] += d.function.name or ""
            slot[1] += d.function.arguments or ""
    return content, [tuple(calls[i]) for i in sorted(calls)]


def test_content_before_a_hermes_call_streams_before_the_end() -> None:
    ts = ToolStream(_plan("auto"))
    sent = [ts.feed(ch, False)[0] or "" for ch in "Sure thing. <tool_c"]
    assert "".join(sent) == "Sure thing. "  # "<tool_c" held back: it may open a call


def test_named_and_required_plans() -> None:
    named = _plan({"type": "function", "function": {"name": "add"}})
    assert named.mode == "named" and named.constraint is not None
    assert named.constraint.json == TOOLS[1]["function"]["parameters"]
    assert _calls(parse_tool_calls(named, '{"a": 1, "b": 2}')[1]) == [("add", {"a": 1, "b": 2})]
    assert _stream(named, '{"a": 1, "b": 2}') == ("", [("add", '{"a": 1, "b": 2}')])
    req = _plan("required")
    assert req.constraint is not None and req.constraint.json["minItems"] == 1
    text = '[{"name": "add", "parameters": {"a": 1, "b": 2}}]'
    assert _calls(parse_tool_calls(req, text)[1]) == [("add", {"a": 1, "b": 2})]
    assert parse_tool_calls(req, '[{"name": "ad') == ('[{"name": "ad', [])  # cut short
    assert _plan("none").constraint is None and _plan(None).mode == "auto"


@pytest.mark.parametrize(("choice", "parser", "tools", "param"), [
    ("auto", None, TOOLS, "tool_choice"),  # no --tool-call-parser
    (None, None, TOOLS, "tool_choice"),  # auto is the default with tools
    ("sometimes", "hermes", TOOLS, "tool_choice"),
    ({"type": "function", "function": {"name": "nope"}}, "hermes", TOOLS, "tool_choice"),
    ({"type": "function"}, "hermes", TOOLS, "tool_choice"),
    ("required", "hermes", TOOLS + TOOLS[:1], "tools"),  # duplicate names
])
def test_bad_tool_choice_is_a_400(choice: Any, parser: str | None, tools: Any, param: str) -> None:
    with pytest.raises(APIError) as e:
        _plan(choice, parser, tools)
    assert e.value.param == param


def test_tool_choice_without_tools() -> None:
    with pytest.raises(APIError) as e:
        tool_plan(ChatCompletionRequest.model_validate({"messages": MSG, "tool_choice": "required"}),
                  "hermes")
    assert e.value.param == "tool_choice"
