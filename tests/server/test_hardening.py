"""Bad input never crashes the server or leaks KV blocks: every class of bad request answers 4xx
with an OpenAI-shaped error naming the field, disconnects abort, a failing step fails only its
requests, and 64 concurrent streams (some cancelled) leave the pool idle."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import pytest
from server_helpers import API_KEY, ServerThread, scrape

AUTH = {"Authorization": f"Bearer {API_KEY}"}

BAD_COMPLETIONS: list[tuple[Any, int, str | None]] = [
    # (body: dict = JSON, bytes = raw), status, param
    (b"{not json", 400, "body"),
    (b'{"prompt": "t5", "max_tokens": NaN}', 400, "body"),
    (b'{"prompt": "t5 \xff\xfe"}', 400, "body"),
    (b"[1, 2, 3]", 400, "body"),
    (b"[" * 5000 + b"]" * 5000, 400, "body"),
    (b"x" * (65 * 1024), 400, "body"),
    ({"max_tokens": 4}, 400, "prompt"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": [1, "a"]}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": "t5", "max_tokens": "10"}, 400, "max_tokens"),
    ({"prompt": "t5", "temperature": True}, 400, "temperature"),
    ({"prompt": "t5", "stream": "yes"}, 400, "stream"),
    ({"prompt": "t5", "temperature": -1}, 400, "temperature"),
    ({"prompt": "t5", "temperature": 1e300}, 400, "temperature"),
    ({"prompt": "t5", "top_p": 0}, 400, "top_p"),
    ({"prompt": "t5", "top_k": -5}, 400, "top_k"),
    ({"prompt": "t5", "min_p": 2}, 400, "min_p"),
    ({"prompt": "t5", "presence_penalty": 3}, 400, "presence_penalty"),
    ({"prompt": "t5", "frequency_penalty": -3}, 400, "frequency_penalty"),
    ({"prompt": "t5", "n": 0}, 400, "n"),
    ({"prompt": "t5", "n": 10**30}, 400, "n"),
    ({"prompt": "t5", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "t5", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "t5", "max_tokens": 10**6}, 400, "max_tokens"),
    ({"prompt": "t5", "logprobs": 50}, 400, "logprobs"),
    ({"prompt": "t5", "seed": -1}, 400, "seed"),
    ({"prompt": "t5", "seed": 2**80}, 400, "seed"),
    ({"prompt": "t5", "stop": [""]}, 400, "stop"),
    ({"prompt": "t5", "stop": ["x"] * 100}, 400, "stop"),
    ({"prompt": "t5", "logit_bias": {"5": 1.0}}, 400, "logit_bias"),
    ({"prompt": "t5", "best_of": 3}, 400, "best_of"),
    ({"prompt": " ".join(["t5"] * 110)}, 400, "prompt"),  # over --max-prompt-tokens
    ({"prompt": [5] * 110}, 400, "prompt"),
    ({"prompt": [5, 99999]}, 400, "prompt"),  # outside the vocabulary
    ({"prompt": ["t5"] * 10}, 400, "prompt"),  # over --max-prompts
    ({"prompt": "t5", "model": "no-such-model"}, 404, "model"),
]

BAD_CHATS: list[tuple[Any, int, str | None]] = [
    ({}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": "t5"}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "t5"}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": " ".join(["t5"] * 120)}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "t5"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "t5"}], "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs"),
    ({"messages": [{"role": "user", "content": "t5"}], "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "t5"}], "tools": [{"type": "function"}]}, 400, "tools"),
    ({"messages": [{"role": "user", "content": "t5"}], "model": "gpt-4"}, 404, "model"),
]


def _post(server: ServerThread, path: str, body: Any) -> httpx.Response:
    url = server.base_url + path
    if isinstance(body, bytes):
        return httpx.post(url, content=body, headers={**AUTH, "Content-Type": "application/json"})
    return httpx.post(url, json=body, headers=AUTH)


@pytest.mark.parametrize(("path", "cases"), [("/v1/completions", BAD_COMPLETIONS),
                                             ("/v1/chat/completions", BAD_CHATS)])
def test_bad_requests_answer_4xx_and_leak_nothing(server: ServerThread, path: str, cases: list[Any]) -> None:
    for body, status, param in cases:
        r = _post(server, path, body)
        assert r.status_code == status, (body if not isinstance(body, bytes) else body[:40], r.text)
        err = r.json()["error"]
        assert err["message"] and err["type"] and set(err) == {"message", "type", "param", "code"}
        assert err["param"] == param, (body if not isinstance(body, bytes) else body[:40], err)
    ok = _post(server, "/v1/completions", {"prompt": "t5 t6", "max_tokens": 3, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"]
    server.wait_idle()


def test_other_routes_answer_in_openai_shape(server: ServerThread) -> None:
    r = httpx.get(server.base_url + "/v1/nothing-here", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = httpx.get(server.base_url + "/v1/completions", headers=AUTH)
    assert r.status_code == 405 and r.json()["error"]["message"]


def _wait_aborted(server: ServerThread, n: int, timeout: float = 20.0) -> None:
    """Until the engine has aborted ``n`` requests in all (a bounded wait on a condition)."""
    deadline = time.monotonic() + timeout
    while server.app.state.async_engine.num_aborted < n:
        assert time.monotonic() < deadline, (
            f"{server.app.state.async_engine.num_aborted} aborts, expected {n}")
        time.sleep(0.02)
    assert server.app.state.async_engine.num_aborted == n


def test_client_disconnects_abort_and_free_blocks(server: ServerThread) -> None:
    aborted = server.app.state.async_engine.num_aborted
    body = {"prompt": "t5 t6 t7 t8 t9", "max_tokens": 120, "temperature": 0, "ignore_eos": True, "stream": True}
    for i in range(2):
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, headers=AUTH) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(3)]
            assert any(g.startswith("data: {") for g in got)
        # the connection is closed here, mid-stream
        _wait_aborted(server, aborted + i + 1)
    chat = {"messages": [{"role": "user", "content": "t5"}], "max_tokens": 100, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=chat, headers=AUTH) as r:
        next(r.iter_lines())
    _wait_aborted(server, aborted + 3)
    # A non-streamed request whose client gives up. The engine thread is held between steps
    # until the client has gone, so the request cannot finish first; then it must be aborted.
    gate = threading.Event()
    held = threading.Thread(target=server.call, args=(lambda e: gate.wait(30),))
    held.start()
    try:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(server.base_url + "/v1/completions", headers=AUTH, timeout=0.05,
                       json={**body, "stream": False, "n": 4})
    finally:
        gate.set()
        held.join()
    _wait_aborted(server, aborted + 4)  # the engine saw every disconnect, this one included
    server.wait_idle()


def test_failing_step_fails_its_requests_and_the_server_recovers(server: ServerThread) -> None:
    def break_next_step(engine: Any) -> None:
        real = engine.step

        def boom() -> Any:
            engine.step = real  # fail once, after the scheduler has allocated blocks
            engine.scheduler.schedule()
            raise RuntimeError("injected failure")

        engine.step = boom

    server.call(break_next_step)
    r = _post(server, "/v1/completions", {"prompt": "t5 t6", "max_tokens": 5, "temperature": 0})
    assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"]
    server.wait_idle()
    server.call(break_next_step)
    with httpx.stream("POST", server.base_url + "/v1/completions", headers=AUTH,
                      json={"prompt": "t5 t6", "max_tokens": 5, "stream": True}) as s:
        events = [line for line in s.iter_lines() if line]
    assert "injected failure" in events[0] and events[-1] == "data: [DONE]"
    server.wait_idle()
    assert httpx.get(server.base_url + "/health").status_code == 200
    ok = _post(server, "/v1/completions", {"prompt": "t5 t6", "max_tokens": 5, "temperature": 0})
    assert ok.status_code == 200


async def _load(base_url: str, n: int, cancel_every: int) -> tuple[int, int]:
    done = cancelled = 0
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    async with httpx.AsyncClient(base_url=base_url, headers=AUTH, limits=limits, timeout=60) as client:

        async def one(i: int) -> None:
            nonlocal done, cancelled
            body = {"prompt": f"t{40 + i % 50} t5 t6", "max_tokens": 12 if i % cancel_every else 100,
                    "temperature": 0.8, "seed": i, "ignore_eos": True, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                chunks = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunks += 1
                        if i % cancel_every == 0 and chunks == 2:
                            cancelled += 1
                            return  # leaving the block closes the stream mid-way
                    elif line == "data: [DONE]":
                        done += 1

        await asyncio.gather(*(one(i) for i in range(n)))
    return done, cancelled


def test_load_64_streams_some_cancelled(server: ServerThread) -> None:
    done, cancelled = asyncio.run(_load(server.base_url, 64, cancel_every=4))
    assert (done, cancelled) == (48, 16)
    server.wait_idle()
    m = scrape(server)
    assert m["pagedllm:num_requests_running"] == 0 and m["pagedllm:num_requests_waiting"] == 0
    assert m["pagedllm:kv_cache_usage_perc"] == 0
    assert m["pagedllm:time_to_first_token_seconds_count"] >= 64


def test_fatal_engine_failure_turns_health_to_503(chat_model: Any) -> None:
    """A failure the engine cannot recover from (e.g. a dead tensor-parallel worker, whose
    exception carries ``fatal = True``) fails in-flight requests and marks the server unhealthy."""
    from pagedllm.engine import LLMEngine
    from pagedllm.server.api import ServerLimits, build_app

    class WorkerGone(RuntimeError):
        fatal = True

    engine = LLMEngine.from_args(model=str(chat_model), block_size=4, num_kv_blocks=64, max_model_len=128)
    app = build_app(engine, model_name="tiny", api_key=API_KEY, limits=ServerLimits())
    with ServerThread(app) as server:
        assert httpx.get(server.base_url + "/health").status_code == 200

        def break_for_good(engine: Any) -> None:
            def boom() -> Any:
                raise WorkerGone("worker rank 1 exited")

            engine.step = boom

        server.call(break_for_good)
        r = _post(server, "/v1/completions", {"prompt": "t5 t6", "max_tokens": 5})
        assert r.status_code == 500 and "worker rank 1 exited" in r.json()["error"]["message"]
        assert httpx.get(server.base_url + "/health").status_code == 503
        again = _post(server, "/v1/completions", {"prompt": "t5 t6", "max_tokens": 5})
        assert again.status_code >= 500


def test_n_over_max_num_seqs_is_a_400_and_the_server_keeps_serving(chat_model: Any) -> None:
    """The engine refuses n > max_num_seqs (the n sequences run together); the server says so."""
    from pagedllm.engine import LLMEngine
    from pagedllm.server.api import ServerLimits, build_app

    engine = LLMEngine.from_args(model=str(chat_model), block_size=4, num_kv_blocks=128,
                                 max_model_len=128, max_num_seqs=2)
    app = build_app(engine, model_name="tiny", api_key=API_KEY, limits=ServerLimits(max_n=4))
    with ServerThread(app) as s:
        r = httpx.post(s.base_url + "/v1/completions", headers=AUTH,
                       json={"prompt": "t5", "n": 3, "max_tokens": 2})
        assert r.status_code == 400, r.text
        assert "max_num_seqs=2" in r.json()["error"]["message"]
        ok = httpx.post(s.base_url + "/v1/completions", headers=AUTH,
                        json={"prompt": "t5", "n": 2, "max_tokens": 2, "ignore_eos": True})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
        s.wait_idle()
