"""Tool calling through the real server and the official ``openai`` client on a random-weight
model whose chat template renders tools and tool calls: named and ``required`` choices return
``tool_calls`` whose arguments validate against the tool's parameters (sampled at temperature 1),
streamed deltas reassemble to the same, ``auto`` reads the hermes text, the history takes
assistant ``tool_calls`` and ``tool`` messages, and bad choices are 400s."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
from server_helpers import API_KEY, ServerThread
from structured_helpers import TOOL_MESSAGES as MESSAGES
from structured_helpers import TOOL_PARAMS as PARAMS
from structured_helpers import TOOLS


@pytest.fixture(scope="module")
def server(tools_server: ServerThread) -> ServerThread:
    return tools_server


def _client(s: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.base_url + "/v1", api_key=API_KEY, max_retries=0)


def _chat(s: ServerThread, **kw: Any) -> Any:
    kw.setdefault("messages", MESSAGES)
    kw.setdefault("max_tokens", 120)
    return _client(s).chat.completions.create(model="m", tools=TOOLS, **kw)


def _check_calls(calls: list[Any]) -> list[tuple[str, Any]]:
    out = []
    for c in calls:
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, PARAMS[c.function.name])
        out.append((c.function.name, args))
    return out


def _streamed(s: ServerThread, **kw: Any) -> tuple[str, list[tuple[str, Any]], str | None]:
    content, calls, reason = "", {}, None
    for chunk in _chat(s, stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                slot = calls.setdefault(d.index, {"name": "", "args": "", "id": None})
                slot["id"] = slot["id"] or d.id
                slot["name"] += (d.function.name or "") if d.function else ""
                slot["args"] += (d.function.arguments or "") if d.function else ""
            reason = ch.finish_reason or reason
    assert all(v["id"] for v in calls.values())
    return content, [(calls[i]["name"], json.loads(calls[i]["args"])) for i in sorted(calls)], reason


@pytest.mark.parametrize("name", ["get_weather", "add"])
def test_named_tool_choice(server: ServerThread, name: str) -> None:
    choice = {"type": "function", "function": {"name": name}}
    for seed in range(5):
        r = _chat(server, temperature=1.0, seed=seed, tool_choice=choice)
        m = r.choices[0].message
        assert m.content is None and [c[0] for c in _check_calls(m.tool_calls)] == [name]
        assert r.choices[0].finish_reason == "stop"
    r = _chat(server, temperature=1.0, seed=3, tool_choice=choice)
    content, calls, reason = _streamed(server, temperature=1.0, seed=3, tool_choice=choice)
    assert content == "" and calls == _check_calls(r.choices[0].message.tool_calls)
    assert reason == "stop"
    server.wait_idle()


def test_required_tool_choice(server: ServerThread) -> None:
    """parallel_tool_calls=false: exactly one call. Otherwise the array has no bound (a random
    model may run out of max_tokens: then no call is read and the text is the content)."""
    names = set()
    for seed in range(6):
        kw = dict(temperature=1.0, seed=seed, tool_choice="required", parallel_tool_calls=False)
        r = _chat(server, **kw)
        c = r.choices[0]
        calls = _check_calls(c.message.tool_calls)
        assert len(calls) == 1 and c.finish_reason == "tool_calls" and c.message.content is None
        names |= {n for n, _ in calls}
        if seed == 0:
            assert _streamed(server, **kw) == ("", calls, "tool_calls")
    assert names <= set(PARAMS)
    many = 0
    for seed in range(4):
        c = _chat(server, temperature=1.0, seed=seed, max_tokens=300, tool_choice="required").choices[0]
        if c.finish_reason == "length":
            assert c.message.tool_calls == [] and c.message.content.startswith("[")
        else:
            many = max(many, len(_check_calls(c.message.tool_calls)))
            assert c.finish_reason == "tool_calls"
    assert many > 1, "parallel calls are allowed by default"
    server.wait_idle()


def test_auto_reads_hermes_tool_calls(server: ServerThread) -> None:
    """The random model would not call a tool by itself: a regex makes it write a hermes call
    after some content, and auto reads it back (streamed too)."""
    regex = r'On it\.\n<tool_call>\{"name": "add", "arguments": \{"a": [1-9], "b": [1-9]\}\}</tool_call>'
    kw = dict(temperature=1.0, seed=4, tool_choice="auto",
              extra_body={"structured_outputs": {"regex": regex}})
    r = _chat(server, **kw)
    c = r.choices[0]
    assert c.message.content == "On it.\n" and c.finish_reason == "tool_calls"
    calls = _check_calls(c.message.tool_calls)
    assert [n for n, _ in calls] == ["add"]
    assert _streamed(server, **kw) == ("On it.\n", calls, "tool_calls")
    plain = _chat(server, temperature=0.0, max_tokens=8, tool_choice="auto")  # no call: content
    assert plain.choices[0].message.tool_calls == [] and plain.choices[0].message.content
    server.wait_idle()


def test_history_with_tool_calls_and_tool_messages(server: ServerThread) -> None:
    first = _chat(server, temperature=0.0, tool_choice={"type": "function",
                                                         "function": {"name": "add"}})
    call = first.choices[0].message.tool_calls[0]
    history = MESSAGES + [first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    r = _chat(server, messages=history, temperature=0.0, max_tokens=4, tool_choice="none")
    assert r.choices[0].message.tool_calls == []
    # the template saw the call: the prompt is longer than the history without it
    assert r.usage.prompt_tokens > _chat(server, messages=MESSAGES, max_tokens=1,
                                         tool_choice="none").usage.prompt_tokens
    without_tools = _client(server).chat.completions.create(model="m", messages=MESSAGES,
                                                            max_tokens=1)
    assert without_tools.usage.prompt_tokens < r.usage.prompt_tokens
    server.wait_idle()


def test_chat_template_kwargs_reach_the_template(server: ServerThread) -> None:
    client = _client(server)
    plain = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1)
    greeted = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1, extra_body={
        "chat_template_kwargs": {"greeting": "Hello there, friend"}})
    assert greeted.usage.prompt_tokens > plain.usage.prompt_tokens


@pytest.mark.parametrize(("kw", "param"), [
    ({"extra_body": {"chat_template_kwargs": {"tokenize": True}}}, "chat_template_kwargs"),
    ({"extra_body": {"chat_template": "{{ x }}"}}, "chat_template"),  # not per request
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "x", "weird": 1}]}, "messages"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{oops"}}]}]},
     "messages"),
])
def test_bad_tool_requests_are_400s(server: ServerThread, kw: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        _chat(server, **kw)
    assert e.value.body["param"] == param, e.value.body
    server.wait_idle()


def test_tokenize_and_detokenize(server: ServerThread) -> None:
    """vLLM's shapes: the chat form counts what a chat completion's prompt holds."""
    import httpx

    def post(path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(server.base_url + path, json=body,
                          headers={"Authorization": f"Bearer {API_KEY}"})

    t = post("/tokenize", {"model": "m", "prompt": "x = 1", "return_token_strs": True}).json()
    want = server.call(lambda e: e.tokenizer.encode("x = 1"))
    assert t["tokens"] == want and t["count"] == len(want) and len(t["token_strs"]) == len(want)
    assert t["max_model_len"] == server.call(lambda e: e.config.scheduler.max_model_len)
    assert post("/detokenize", {"model": "m", "tokens": want}).json() == {
        "prompt": server.call(lambda e: e.tokenizer.decode(want))}
    chat = post("/tokenize", {"model": "m", "messages": MESSAGES}).json()
    r = _client(server).chat.completions.create(model="m", messages=MESSAGES, max_tokens=1)
    assert chat["count"] == r.usage.prompt_tokens
    for path, body, param in [("/tokenize", {"prompt": "x", "messages": MESSAGES}, "prompt"),
                              ("/tokenize", {"prompt": "x", "nope": 1}, "nope"),
                              ("/detokenize", {"tokens": [1, 10**6]}, "tokens")]:
        bad = post(path, body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    assert httpx.post(server.base_url + "/tokenize", json={"prompt": "x"}).status_code == 401
    server.wait_idle()
