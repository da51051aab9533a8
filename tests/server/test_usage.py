"""``usage`` as a property, for completions and chat, streamed and not, with ``n`` > 1 and several
prompts: the prompt is counted once per prompt (not once per choice: /tokenize says how many
tokens it has), ``completion_tokens`` is the sum over the choices of the tokens each generated
(counted from their logprobs, one entry per token), and ``total_tokens`` is both."""

from __future__ import annotations

import json
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import API_KEY, ServerThread

AUTH = {"Authorization": f"Bearer {API_KEY}"}
WORDS = st.lists(st.integers(5, 500).map(lambda i: f"t{i}"), min_size=1, max_size=12).map(" ".join)
CASES = st.fixed_dictionaries({
    "prompts": st.lists(WORDS, min_size=1, max_size=3),
    "n": st.integers(1, 4),
    "max_tokens": st.integers(1, 8),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "chat": st.booleans(),
})


def _body(case: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"n": case["n"], "max_tokens": case["max_tokens"], "seed": 1,
                            "ignore_eos": case["ignore_eos"], "stream": case["stream"]}
    if case["stream"]:
        body["stream_options"] = {"include_usage": True}
    if case["chat"]:
        return "/v1/chat/completions", {**body, "logprobs": True, "top_logprobs": 0,
                                        "messages": [{"role": "user", "content": case["prompts"][0]}]}
    prompt = case["prompts"] if len(case["prompts"]) > 1 else case["prompts"][0]
    return "/v1/completions", {**body, "logprobs": 0, "prompt": prompt}


def _tokens(choice: dict[str, Any], chat: bool) -> int:
    """Tokens one choice (or one delta of it) carries: its logprobs have one entry per token."""
    lp = choice.get("logprobs")
    if lp is None:
        return 0
    return len(lp["content"] or []) if chat else len(lp["tokens"])


def _answer(client: httpx.Client, path: str, body: dict[str, Any]) -> tuple[dict[int, int], dict[str, int]]:
    """({choice index: tokens generated}, usage), streamed or not."""
    chat = path.endswith("chat/completions")
    per_choice: dict[int, int] = {}
    if not body["stream"]:
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
        for c in r.json()["choices"]:
            per_choice[c["index"]] = per_choice.get(c["index"], 0) + _tokens(c, chat)
        return per_choice, r.json()["usage"]
    usage = None
    with client.stream("POST", path, json=body) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                per_choice[c["index"]] = per_choice.get(c["index"], 0) + _tokens(c, chat)
            if chunk.get("usage") is not None:
                usage = chunk["usage"]
    assert usage is not None
    return per_choice, usage


@given(case=CASES)
@settings(max_examples=30, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_usage_counts_the_prompt_once_and_every_choice(server: ServerThread, case: dict[str, Any]) -> None:
    path, body = _body(case)
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as client:
        if case["chat"]:
            prompts = [{"messages": body["messages"]}]
        else:
            prompts = [{"prompt": p} for p in case["prompts"]]
        prompt_tokens = sum(client.post("/tokenize", json=p).json()["count"] for p in prompts)
        per_choice, usage = _answer(client, path, body)
    assert len(per_choice) == case["n"] * len(prompts)
    assert all(1 <= k <= case["max_tokens"] for k in per_choice.values()), per_choice
    assert usage == {"prompt_tokens": prompt_tokens, "completion_tokens": sum(per_choice.values()),
                     "total_tokens": prompt_tokens + sum(per_choice.values())}, (case, per_choice)
