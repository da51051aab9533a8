"""litellm (``hosted_vllm/``) and LangChain (``ChatOpenAI``) against the real server, unchanged
(issue 33): their greedy text equals the official ``openai`` client's, streamed and not; a
named tool choice comes back as their parsed tool calls, valid against the tool's parameters;
LangChain's ``with_structured_output`` returns an object valid against the schema. Slow suite:
the packages are the ``clients`` extra, which CI installs for it."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
from server_helpers import API_KEY, ServerThread
from structured_helpers import SMALL_SCHEMA, TOOLS
from structured_helpers import TOOL_MESSAGES as MESSAGES
from structured_helpers import TOOL_PARAMS as PARAMS

pytestmark = pytest.mark.slow
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server(tools_server: ServerThread) -> ServerThread:
    return tools_server


@pytest.fixture(scope="module")
def openai_text(server: ServerThread) -> str:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)
    r = client.chat.completions.create(model="m", messages=MESSAGES, temperature=0,
                                       max_tokens=MAX_TOKENS)
    text = r.choices[0].message.content
    assert text  # something to compare
    return text


def test_litellm_hosted_vllm(server: ServerThread, openai_text: str) -> None:
    litellm = pytest.importorskip("litellm")
    kw: dict[str, Any] = dict(model="hosted_vllm/m", api_base=server.base_url + "/v1",
                              api_key=API_KEY, messages=MESSAGES, temperature=0,
                              max_tokens=MAX_TOKENS)
    r = litellm.completion(**kw)
    assert r.choices[0].message.content == openai_text
    assert r.usage.completion_tokens == MAX_TOKENS or r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in litellm.completion(**kw, stream=True))
    assert streamed == openai_text
    r = litellm.completion(**{**kw, "max_tokens": 120}, tools=TOOLS,
                           tool_choice={"type": "function", "function": {"name": "add"}})
    calls = r.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["add"]
    jsonschema.validate(json.loads(calls[0].function.arguments), PARAMS["add"])


def test_langchain_chat_openai(server: ServerThread, openai_text: str) -> None:
    lc = pytest.importorskip("langchain_openai")
    chat = lc.ChatOpenAI(model="m", base_url=server.base_url + "/v1", api_key=API_KEY,
                         temperature=0, max_tokens=MAX_TOKENS, max_retries=0)
    text = MESSAGES[0]["content"]
    assert chat.invoke(text).content == openai_text
    assert "".join(str(c.content) for c in chat.stream(text)) == openai_text
    long = chat.bind(max_tokens=150)
    msg = long.bind_tools(TOOLS, tool_choice="get_weather").invoke(text)
    assert [c["name"] for c in msg.tool_calls] == ["get_weather"]
    jsonschema.validate(msg.tool_calls[0]["args"], PARAMS["get_weather"])
    schema = {"title": "item", **SMALL_SCHEMA}
    value = chat.bind(max_tokens=150).with_structured_output(schema, method="json_schema").invoke(text)
    jsonschema.validate(value, SMALL_SCHEMA)
