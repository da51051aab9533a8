"""The OpenAI-compatible server end to end: the official ``openai`` client against a real uvicorn
server on a loopback port (completions, chat, streaming, n, logprobs, stop, usage), auth, metrics."""

from __future__ import annotations

import math
from typing import Any

import httpx
import pytest
from openai import AuthenticationError, NotFoundError, OpenAI
from server_helpers import API_KEY, ServerThread, scrape

GREEDY: dict[str, Any] = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def client(server: ServerThread) -> OpenAI:
    return OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=30)


def _words(text: str) -> list[str]:
    return text.split()


def test_completion_greedy_usage_and_stream_agree(client: OpenAI, server: ServerThread) -> None:
    r = client.completions.create(model="tiny", prompt="t5 t6 t7", max_tokens=8, **GREEDY)
    c = r.choices[0]
    assert r.object == "text_completion" and r.model == "tiny"
    assert c.finish_reason == "length" and len(_words(c.text)) == 8
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 8, 11)

    chunks = list(client.completions.create(model="tiny", prompt="t5 t6 t7", max_tokens=8, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == c.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].usage.prompt_tokens == 3
    server.wait_idle()


def test_token_id_prompts_and_batches(client: OpenAI) -> None:
    one = client.completions.create(model="tiny", prompt="t9 t45", max_tokens=4, **GREEDY).choices[0].text
    ids = client.completions.create(model="tiny", prompt=[9, 45], max_tokens=4, **GREEDY).choices[0].text
    assert ids == one
    batch = client.completions.create(model="tiny", prompt=["t47", "t9 t45"], max_tokens=4, **GREEDY)
    assert [ch.index for ch in batch.choices] == [0, 1]
    assert batch.choices[1].text == one
    assert batch.usage is not None and batch.usage.prompt_tokens == 3 and batch.usage.completion_tokens == 8
    echoed = client.completions.create(model="tiny", prompt="t9 t45", max_tokens=4, echo=True, **GREEDY)
    assert echoed.choices[0].text == "t9 t45" + one
    streamed = client.completions.create(model="tiny", prompt=["t47", "t9 t45"], max_tokens=4, stream=True,
                                         **GREEDY)
    texts = ["", ""]
    for ch in streamed:
        for choice in ch.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in batch.choices]


def test_stop_string_plain_and_streamed(client: OpenAI) -> None:
    full = client.completions.create(model="tiny", prompt="t60 t61", max_tokens=8, **GREEDY).choices[0].text
    stop = _words(full)[3]
    expected = full[: full.find(stop)]
    r = client.completions.create(model="tiny", prompt="t60 t61", max_tokens=8, stop=[stop], **GREEDY)
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="tiny", prompt="t60 t61", max_tokens=8, stop=stop, stream=True,
                                         **GREEDY)
    parts = list(streamed)
    assert "".join(p.choices[0].text for p in parts) == expected
    assert parts[-1].choices[0].finish_reason == "stop"


def test_n_samples_seeded(client: OpenAI) -> None:
    kw: dict[str, Any] = dict(model="tiny", prompt="t70", max_tokens=6, n=2, temperature=1.0, seed=7,
                              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert sorted(ch.index for ch in a.choices) == [0, 1]
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]  # seeded: reproducible
    assert a.choices[0].text != a.choices[1].text
    assert a.usage is not None and a.usage.completion_tokens == 12
    streamed: dict[int, str] = {0: "", 1: ""}
    for ch in client.completions.create(stream=True, **kw):
        for choice in ch.choices:
            streamed[choice.index] += choice.text
    assert [streamed[0], streamed[1]] == [ch.text for ch in a.choices]


def test_completion_logprobs(client: OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt="t40 t41", max_tokens=5, logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert " ".join(lp.tokens) == r.choices[0].text.strip()
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and chosen <= 0
        assert max(top, key=top.__getitem__) == tok  # greedy picks the most likely token
        assert math.isclose(top[tok], chosen, abs_tol=1e-5)
    assert lp.text_offset == sorted(lp.text_offset)
    streamed = list(client.completions.create(model="tiny", prompt="t40 t41", max_tokens=5, logprobs=3,
                                              stream=True, **GREEDY))
    tokens = [t for ch in streamed for t in (ch.choices[0].logprobs.tokens or [])]  # type: ignore[union-attr]
    assert tokens == lp.tokens


def test_chat_completion_stream_and_logprobs(client: OpenAI, server: ServerThread) -> None:
    msgs: list[Any] = [{"role": "system", "content": "t7"}, {"role": "user", "content": "t5 t6"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, logprobs=True,
                                       top_logprobs=2, **GREEDY)
    c = r.choices[0]
    assert r.object == "chat.completion" and c.message.role == "assistant"
    assert c.finish_reason == "length" and len(_words(c.message.content or "")) == 5
    assert r.usage is not None and r.usage.prompt_tokens == 4  # "t7 t5 t6 t4"
    assert c.logprobs is not None and c.logprobs.content is not None and len(c.logprobs.content) == 5
    for entry in c.logprobs.content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
        assert entry.bytes == list(entry.token.encode())
    # max_completion_tokens is the newer name of max_tokens
    r2 = client.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=5, **GREEDY)
    assert r2.choices[0].message.content == c.message.content

    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == c.message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    server.wait_idle()


def test_models_health_version(client: OpenAI, server: ServerThread) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/version").json()["version"]


def test_auth(server: ServerThread) -> None:
    url = server.base_url + "/v1/completions"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(url, json={"prompt": "t5", "max_tokens": 1}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.base_url + "/v1/models").status_code == 401
    assert httpx.get(server.base_url + "/health").status_code == 200  # open
    assert httpx.get(server.base_url + "/metrics").status_code == 200  # open
    bad = OpenAI(base_url=server.base_url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(AuthenticationError):
        bad.completions.create(model="tiny", prompt="t5", max_tokens=1)
    with pytest.raises(NotFoundError):
        OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0).completions.create(
            model="gpt-4", prompt="t5", max_tokens=1)


METRICS = [
    "pagedllm:num_requests_running", "pagedllm:num_requests_waiting", "pagedllm:num_requests_swapped",
    "pagedllm:kv_cache_usage_perc", "pagedllm:prefix_cache_queries_total", "pagedllm:prefix_cache_hits_total",
    "pagedllm:num_preemptions_total", "pagedllm:prompt_tokens_total", "pagedllm:generation_tokens_total",
    "pagedllm:time_to_first_token_seconds_count", "pagedllm:inter_token_latency_seconds_count",
    "pagedllm:e2e_request_latency_seconds_count",
]


def test_metrics_count_tokens(client: OpenAI, server: ServerThread) -> None:
    before = scrape(server)
    client.completions.create(model="tiny", prompt="t50 t51 t52 t53 t54", max_tokens=6, **GREEDY)
    server.wait_idle()
    after = scrape(server)
    for name in METRICS:
        assert name in after, name
    assert after["pagedllm:prompt_tokens_total"] - before.get("pagedllm:prompt_tokens_total", 0) == 5
    assert after["pagedllm:generation_tokens_total"] - before.get("pagedllm:generation_tokens_total", 0) == 6
    assert after["pagedllm:e2e_request_latency_seconds_count"] - before.get(
        "pagedllm:e2e_request_latency_seconds_count", 0) == 1
    assert after["pagedllm:inter_token_latency_seconds_count"] - before.get(
        "pagedllm:inter_token_latency_seconds_count", 0) == 5
    assert after["pagedllm:prefix_cache_queries_total"] > 0
    assert after["pagedllm:num_requests_running"] == after["pagedllm:num_requests_waiting"] == 0
    assert after["pagedllm:kv_cache_usage_perc"] == 0
