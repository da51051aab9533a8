"""``/v1/responses`` with the official ``openai`` client (``client.responses``): greedy text and
usage equal ``/v1/chat/completions``' for the same conversation; the streamed events come in
OpenAI's order, numbered, and their deltas add up to the whole answer; a named tool choice
comes back as a ``function_call`` item (streamed as argument deltas too), and a
``function_call_output`` round trip equals the chat path's tool messages; bad fields are 400s
naming the Responses field."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from server_helpers import API_KEY, ServerThread
from structured_helpers import TOOL_PARAMS as PARAMS
from structured_helpers import TOOLS

QUESTION = "What is the weather in Oslo, and what is 2 + 3?"
FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses shape


@pytest.fixture(scope="module")
def server(tools_server: ServerThread) -> ServerThread:
    return tools_server


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)


def _chat(client: openai.OpenAI, messages: list[dict[str, Any]], **kw: Any) -> Any:
    return client.chat.completions.create(model="m", messages=messages, temperature=0, **kw)


@pytest.mark.parametrize("max_tokens", [12, 200])
def test_text_and_usage_equal_chat_completions(client: openai.OpenAI, max_tokens: int) -> None:
    r = client.responses.create(model="m", input=QUESTION, instructions="Be brief.",
                                max_output_tokens=max_tokens, temperature=0)
    chat = _chat(client, [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": QUESTION}], max_completion_tokens=max_tokens)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "m"
    assert r.output_text == chat.choices[0].message.content
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == chat.usage.total_tokens
    if chat.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed" and r.incomplete_details is None
    assert r.store is False and r.instructions == "Be brief."


def test_streamed_events_add_up_to_the_answer(client: openai.OpenAI) -> None:
    whole = client.responses.create(model="m", input=QUESTION, max_output_tokens=24, temperature=0)
    events = list(client.responses.create(model="m", input=QUESTION, max_output_tokens=24,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert kinds[4 + len(deltas):] == ["response.output_text.done", "response.content_part.done",
                                       "response.output_item.done", f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text
    done = events[-1].response
    assert done.output_text == whole.output_text and done.usage.output_tokens == 24
    assert events[0].response.status == "in_progress" and events[0].response.output == []


def test_a_named_tool_call_and_its_output_round_trip(client: openai.OpenAI) -> None:
    choice = {"type": "function", "name": "get_weather"}
    r = client.responses.create(model="m", input=QUESTION, tools=FLAT_TOOLS, tool_choice=choice,
                                max_output_tokens=120, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert [c.name for c in calls] == ["get_weather"] and calls[0].call_id
    args = json.loads(calls[0].arguments)
    jsonschema.validate(args, PARAMS["get_weather"])
    streamed = list(client.responses.create(model="m", input=QUESTION, tools=FLAT_TOOLS,
                                            tool_choice=choice, max_output_tokens=120,
                                            temperature=0, stream=True))
    arg_deltas = "".join(e.delta for e in streamed
                         if e.type == "response.function_call_arguments.delta")
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert arg_deltas == done[0].arguments == calls[0].arguments and done[0].name == "get_weather"
    # the call and its output sent back: the same answer as the chat path's tool messages
    history = [{"role": "user", "content": QUESTION},
               {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}]
    again = client.responses.create(model="m", input=history, tools=FLAT_TOOLS, tool_choice="none",
                                    max_output_tokens=16, temperature=0)
    chat = _chat(client, [{"role": "user", "content": QUESTION},
                          {"role": "assistant", "content": None, "tool_calls": [{
                              "id": "call_1", "type": "function", "function": {
                                  "name": "get_weather", "arguments": calls[0].arguments}}]},
                          {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}],
                 tools=TOOLS, tool_choice="none", max_completion_tokens=16)
    assert again.output_text == chat.choices[0].message.content


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "frobnicate": 1}, "frobnicate"),
    ({"input": []}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text"),
    ({"input": "hi", "model": "nope"}, "model"),
])
def test_bad_fields_are_400s_naming_them(server: ServerThread, body: dict[str, Any],
                                         param: str) -> None:
    r = httpx.post(server.base_url + "/v1/responses", json=body, timeout=30,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == (404 if param == "model" else 400), r.text
    assert r.json()["error"]["param"] == param, r.text
    ok = httpx.post(server.base_url + "/v1/responses", json={"input": "hi", "max_output_tokens": 2},
                    timeout=30, headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] == 2  # still serving
