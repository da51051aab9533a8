"""Every class of bad request, table-driven: types, limits, nesting, huge bodies, invalid UTF-8 and
lone surrogates, out-of-vocabulary token ids in every field, context overflow, unknown models.
Each answers a 4xx with an OpenAI-shaped body naming the field, while valid requests running at
the same time come out exactly as they do alone, and the pool is idle afterwards."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from server_helpers import API_KEY, ServerThread

AUTH = {"Authorization": f"Bearer {API_KEY}"}
U = "t5 "  # one token of the word-level tokenizer

# (body: dict = JSON, bytes = raw), status, param, text the message must contain
Case = tuple[Any, int, "str | None", str]

BAD_COMPLETIONS: list[Case] = [
    # the body itself
    (b"{not json", 400, "body", "not valid JSON"),
    (b'{"prompt": "t5", "max_tokens": NaN}', 400, "body", "NaN"),
    (b'{"prompt": "t5 \xff\xfe"}', 400, "body", "UTF-8"),
    (b'{"prompt": "t5 \xed\xa0\x80"}', 400, "body", "UTF-8"),  # a surrogate encoded as UTF-8
    (b"[1, 2, 3]", 400, "body", "JSON object"),
    (b"[" * 5000 + b"]" * 5000, 400, "body", "not valid JSON"),
    (b'{"prompt": ' + b'{"a": ' * 3000 + b"1" + b"}" * 3000 + b"}", 400, "body", "not valid JSON"),
    (b"x" * (65 * 1024), 413, "body", "limit"),
    # lone UTF-16 surrogates, in every place text goes
    (b'{"prompt": "\\ud800abc", "max_tokens": 4}', 400, "prompt", "surrogate"),
    (b'{"prompt": ["t5", "t6 \\udc00"], "max_tokens": 4}', 400, "prompt", "surrogate"),
    (b'{"prompt": "\\ud800abc", "max_tokens": 4, "stream": true}', 400, "prompt", "surrogate"),
    (b'{"prompt": "t5", "stop": ["\\ud800"]}', 400, "stop", "surrogate"),
    (b'{"prompt": "t5", "stop": "ab\\udfff"}', 400, "stop", "surrogate"),
    (b'{"prompt": "t5", "user": "\\ud800"}', 400, "user", "surrogate"),
    # types
    ({"max_tokens": 4}, 400, "prompt", "prompt"),
    ({"prompt": 5}, 400, "prompt", "prompt"),
    ({"prompt": [1, "a"]}, 400, "prompt", "prompt"),
    ({"prompt": [[1], "a"]}, 400, "prompt", "prompt"),
    ({"prompt": []}, 400, "prompt", "empty"),
    ({"prompt": ""}, 400, "prompt", "empty"),
    ({"prompt": {"text": "t5"}}, 400, "prompt", "prompt"),
    ({"prompt": "t5", "max_tokens": "10"}, 400, "max_tokens", "max_tokens"),
    ({"prompt": "t5", "max_tokens": 4.5}, 400, "max_tokens", "max_tokens"),
    ({"prompt": "t5", "temperature": True}, 400, "temperature", "temperature"),
    ({"prompt": "t5", "stream": "yes"}, 400, "stream", "stream"),
    ({"prompt": "t5", "stop": 5}, 400, "stop", "stop"),
    ({"prompt": "t5", "stop_token_ids": "5"}, 400, "stop_token_ids", "stop_token_ids"),
    ({"prompt": "t5", "stop_token_ids": [5.5]}, 400, "stop_token_ids", "stop_token_ids"),
    ({"prompt": "t5", "stream_options": {"include_usage": "yes"}}, 400, "stream_options", "include_usage"),
    # ranges and limits
    ({"prompt": "t5", "temperature": -1}, 400, "temperature", "temperature"),
    ({"prompt": "t5", "temperature": 1e300}, 400, "temperature", "temperature"),
    ({"prompt": "t5", "top_p": 0}, 400, "top_p", "top_p"),
    ({"prompt": "t5", "top_k": -5}, 400, "top_k", "top_k"),
    ({"prompt": "t5", "min_p": 2}, 400, "min_p", "min_p"),
    ({"prompt": "t5", "presence_penalty": 3}, 400, "presence_penalty", "presence_penalty"),
    ({"prompt": "t5", "frequency_penalty": -3}, 400, "frequency_penalty", "frequency_penalty"),
    ({"prompt": "t5", "repetition_penalty": 0}, 400, "repetition_penalty", "repetition_penalty"),
    ({"prompt": "t5", "n": 0}, 400, "n", "n="),
    ({"prompt": "t5", "n": 10**30}, 400, "n", "n="),
    ({"prompt": "t5", "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
    ({"prompt": "t5", "max_tokens": -1}, 400, "max_tokens", "max_tokens"),
    ({"prompt": "t5", "max_tokens": 10**6}, 400, "max_tokens", "max_tokens"),
    ({"prompt": "t5", "min_tokens": 9, "max_tokens": 4}, 400, "min_tokens", "min_tokens"),
    ({"prompt": "t5", "logprobs": 50}, 400, "logprobs", "logprobs"),
    ({"prompt": "t5", "seed": -1}, 400, "seed", "seed"),
    ({"prompt": "t5", "seed": 2**80}, 400, "seed", "seed"),
    ({"prompt": "t5", "stop": [""]}, 400, "stop", "stop"),
    ({"prompt": "t5", "stop": ["x"] * 100}, 400, "stop", "stop"),
    ({"prompt": "t5", "stop": ["x" * 300]}, 400, "stop", "stop"),
    ({"prompt": "t5", "stop_token_ids": list(range(65))}, 400, "stop_token_ids", "stop_token_ids"),
    ({"prompt": "t5", "best_of": 3}, 400, "best_of", "best_of"),
    ({"prompt": " ".join(["t5"] * 110)}, 400, "prompt", "--max-prompt-tokens"),
    ({"prompt": [5] * 110}, 400, "prompt", "--max-prompt-tokens"),
    ({"prompt": ["t5"] * 10}, 400, "prompt", "limit"),  # over --max-prompts
    # token ids outside the vocabulary [0, 512), in every field that carries them
    ({"prompt": [5, 99999]}, 400, "prompt", "outside"),
    ({"prompt": [5, -1]}, 400, "prompt", "outside"),
    ({"prompt": [[5], [512]]}, 400, "prompt", "outside"),
    ({"prompt": "t5", "max_tokens": 8, "stop_token_ids": [99999], "min_tokens": 3}, 400, "stop_token_ids",
     "outside the vocabulary"),
    ({"prompt": "t5", "max_tokens": 8, "stop_token_ids": [99999]}, 400, "stop_token_ids", "outside"),
    ({"prompt": "t5", "max_tokens": 8, "stop_token_ids": [-5], "min_tokens": 3}, 400, "stop_token_ids",
     "outside"),
    ({"prompt": "t5", "max_tokens": 8, "stop_token_ids": [512], "stream": True}, 400, "stop_token_ids",
     "outside"),
    ({"prompt": "t5", "logit_bias": {"99999": 1.0}}, 400, "logit_bias", "logit_bias"),
    ({"prompt": "t5", "logit_bias": {"-3": 1.0}}, 400, "logit_bias", "logit_bias"),
    ({"prompt": "t5", "logit_bias": {"t5": 1.0}}, 400, "logit_bias", "not a token id"),
    ({"prompt": "t5", "logit_bias": {"5": 101.0}}, 400, "logit_bias", "[-100, 100]"),
    ({"prompt": "t5", "allowed_token_ids": [5, 99999]}, 400, "allowed_token_ids", "outside"),
    # fields this server does not honour: named, never silently ignored
    ({"prompt": "t5", "no_such_field": 1}, 400, "no_such_field", "no_such_field"),
    ({"prompt": "t5", "use_beam_search": True}, 400, "use_beam_search", "LLM.beam_search"),
    ({"prompt": "t5", "stream_options": {"include_usage": True, "x": 1}}, 400, "stream_options", "x"),
    # the context: prompt + max_tokens must fit max_model_len=128 (vLLM's message)
    ({"prompt": [5] * 100, "max_tokens": 50}, 400, "max_tokens",
     "This model's maximum context length is 128 tokens. However, you requested 50 output tokens "
     "and your prompt contains 100 input tokens, for a total of 150 tokens"),
    ({"prompt": ["t5", U * 90], "max_tokens": 40, "stream": True}, 400, "max_tokens",
     "maximum context length is 128 tokens"),
    # unknown model: the served name, never a path
    ({"prompt": "t5", "model": "no-such-model"}, 404, "model", "'tiny'"),
]

BAD_CHATS: list[Case] = [
    ({}, 400, "messages", "messages"),
    ({"messages": []}, 400, "messages", "messages"),
    ({"messages": "t5"}, 400, "messages", "messages"),
    ({"messages": [{"role": "wizard", "content": "t5"}]}, 400, "messages", "role"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages", "content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages", "image_url"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, 400, "messages",
     "messages.0.content"),
    ({"messages": [{"role": "user", "content": " ".join(["t5"] * 120)}]}, 400, "messages",
     "--max-prompt-tokens"),
    (b'{"messages": [{"role": "user", "content": "\\ud800abc"}]}', 400, "messages", "surrogate"),
    (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udbff"}]}], "stream": true}',
     400, "messages", "surrogate"),
    (b'{"messages": [{"role": "user", "content": "t5", "name": "\\udc00"}]}', 400, "messages", "surrogate"),
    ({"messages": [{"role": "user", "content": "t5"}], "top_logprobs": 2}, 400, "top_logprobs", "logprobs"),
    ({"messages": [{"role": "user", "content": "t5"}], "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs", "top_logprobs"),
    ({"messages": [{"role": "user", "content": "t5"}], "max_completion_tokens": 0}, 400,
     "max_completion_tokens", "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "t5"}], "stop_token_ids": [99999]}, 400, "stop_token_ids",
     "outside"),
    ({"messages": [{"role": "user", "content": U * 90}], "max_completion_tokens": 60}, 400,
     "max_completion_tokens", "maximum context length is 128 tokens"),
    ({"messages": [{"role": "user", "content": U * 90}], "max_tokens": 60}, 400, "max_tokens",
     "maximum context length is 128 tokens"),
    ({"messages": [{"role": "user", "content": "t5"}], "tools": [{"type": "function"}]}, 400, "tools",
     "function"),
    # the word-level test tokenizer cannot drive a grammar: said so, naming the field
    ({"messages": [{"role": "user", "content": "t5"}], "guided_regex": "[0-9]+"}, 400, "guided_regex",
     "tokenizer cannot drive a grammar"),
    ({"messages": [{"role": "user", "content": "t5"}], "model": "gpt-4"}, 404, "model", "'tiny'"),
]

VALID = [{"prompt": f"t{5 + i} t{40 + i} t7", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
         for i in range(4)]


def _wrong(r: httpx.Response, status: int, param: str | None, text: str) -> str | None:
    """What is wrong with the answer to a bad request (None: a 4xx as it should be)."""
    if r.status_code != status:
        return f"HTTP {r.status_code}: {r.text[:200]}"
    err = r.json()["error"]
    if set(err) != {"message", "type", "param", "code"} or err["type"] != "invalid_request_error":
        return f"not OpenAI-shaped: {err}"
    if err["param"] != param or text not in err["message"]:
        return f"param {err['param']!r}, message {err['message']!r}"
    return None


async def _text(client: httpx.AsyncClient, body: dict[str, Any]) -> str:
    """The completion's text, streamed (the deltas joined) or not."""
    if not body.get("stream"):
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["text"])
    text = ""
    async with client.stream("POST", "/v1/completions", json=body) as s:
        assert s.status_code == 200
        async for line in s.aiter_lines():
            if line.startswith("data: {"):
                text += "".join(c["text"] for c in json.loads(line[len("data: "):])["choices"])
    return text


@pytest.mark.parametrize(("path", "cases"), [("/v1/completions", BAD_COMPLETIONS),
                                             ("/v1/chat/completions", BAD_CHATS)])
def test_every_bad_input_class_is_a_4xx_and_valid_neighbours_are_unaffected(
        server: ServerThread, path: str, cases: list[Case]) -> None:
    async def run() -> tuple[list[str], list[str]]:
        headers = {**AUTH, "Content-Type": "application/json"}
        limits = httpx.Limits(max_connections=1)
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=60) as client, \
                httpx.AsyncClient(base_url=server.base_url, headers=headers, timeout=60,
                                  limits=limits) as bad_client:
            alone = [await _text(client, b) for b in VALID]

            async def bad() -> None:
                for body, status, param, text in cases:
                    raw = {"content": body} if isinstance(body, bytes) else {"json": body}
                    try:  # one keep-alive connection for all: a 4xx must not drop it
                        r = await bad_client.post(path, **raw)  # type: ignore[arg-type]
                        why = _wrong(r, status, param, text)
                    except httpx.TransportError as e:
                        why = f"the connection broke: {e!r}"
                    if why is not None:
                        wrong.append(f"{body if isinstance(body, dict) else body[:60]!r}: {why}")

            *together, _ = await asyncio.gather(
                *(_text(client, {**b, "stream": i % 2 == 1}) for i, b in enumerate(VALID)), bad())
            return alone, together

    wrong: list[str] = []
    alone, together = asyncio.run(run())
    assert not wrong, "\n".join(wrong)
    assert together == alone
    server.wait_idle()


def test_omitted_max_tokens_is_what_the_context_leaves(server: ServerThread) -> None:
    """Chat without max_tokens generates up to max_model_len (vLLM's rule); completions default to 16."""
    body = {"messages": [{"role": "user", "content": U * 95}], "temperature": 0, "ignore_eos": True}
    r = httpx.post(server.base_url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == 96 and usage["completion_tokens"] == 128 - 96
    assert r.json()["choices"][0]["finish_reason"] == "length"
    r = httpx.post(server.base_url + "/v1/completions", headers=AUTH, timeout=60,
                   json={"prompt": "t5", "temperature": 0, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 16
    server.wait_idle()


# a lone surrogate escape in a JSON key, in every place a client's keys go; each route
KEY = '"\\ud800"'  # the JSON text \ud800: decodes to a lone surrogate no encoder takes
SURROGATE_KEYS: list[tuple[str, str]] = [
    ("/v1/completions", '{"prompt": "t5", "max_tokens": 2, %s: 1}'),
    ("/v1/completions", '{"prompt": "t5", "max_tokens": 2, "metadata": {%s: "x"}}'),
    ("/v1/completions", '{"prompt": "t5", "max_tokens": 2, "logit_bias": {%s: 1.0}}'),
    ("/v1/completions", '{"prompt": "t5", "max_tokens": 2, "stream": true, %s: 1}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "t5"}], %s: 1}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "t5"}], "metadata": {%s: 1}}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "t5"}], "logit_bias": {%s: 1}}'),
    ("/v1/chat/completions",
     '{"messages": [{"role": "user", "content": "t5"}], "chat_template_kwargs": {%s: 1}}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "t5", %s: 1}]}'),
    ("/tokenize", '{"prompt": "t5", %s: 1}'),
    ("/tokenize", '{"messages": [{"role": "user", "content": "t5"}], "chat_template_kwargs": {%s: 1}}'),
    ("/detokenize", '{"tokens": [5], %s: 1}'),
]


@pytest.mark.parametrize(("path", "body"), SURROGATE_KEYS)
def test_a_lone_surrogate_in_a_key_is_a_400_that_escapes_it(server: ServerThread, path: str,
                                                              body: str) -> None:
    """The 400 names the key, escaped (``\\ud800`` as text): echoing it raw made writing the
    response fail (UnicodeEncodeError: a 500 or a reset connection)."""
    with httpx.Client(base_url=server.base_url, headers={**AUTH, "Content-Type": "application/json"},
                      timeout=30) as client:
        r = client.post(path, content=(body % KEY).encode())
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_encoding" and "surrogate" in err["message"], err
        assert "\\ud800" in err["message"] and "\ud800" not in r.text, err
        assert client.post(path, content=(body % '"ok"').encode()).status_code < 500  # same connection
    server.wait_idle()


JSON_ROUTES = [("/v1/completions", {"prompt": "t5", "max_tokens": 1}),
               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t5"}], "max_tokens": 1}),
               ("/tokenize", {"prompt": "t5"}), ("/detokenize", {"tokens": [5]})]


@pytest.mark.parametrize(("path", "body"), JSON_ROUTES)
def test_only_json_bodies_are_read(server: ServerThread, path: str, body: dict[str, Any]) -> None:
    """A body that does not say it is JSON is a 415: text/plain, form data and a body with no
    type are what a web page may send cross-site without a preflight (CSRF on a server without
    --api-key); application/json (with a charset) and +json types are read."""
    raw = json.dumps(body).encode()
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=30) as client:
        for ctype in ("text/plain", "text/plain; charset=utf-8", "application/x-www-form-urlencoded",
                      "multipart/form-data; boundary=x", "application/jsonx", "json", None):
            headers = {} if ctype is None else {"Content-Type": ctype}
            r = client.post(path, content=raw, headers=headers)
            assert r.status_code == 415, (ctype, r.text)
            err = r.json()["error"]
            assert err["code"] == "unsupported_media_type" and "application/json" in err["message"]
        for ctype in ("application/json", "application/json; charset=utf-8", "Application/JSON",
                      "application/vnd.pagedllm+json"):
            r = client.post(path, content=raw, headers={"Content-Type": ctype})
            assert r.status_code == 200, (ctype, r.text)
    server.wait_idle()
