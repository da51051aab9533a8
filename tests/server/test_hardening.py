"""The server under trouble never leaks KV blocks: disconnects abort, a failing step fails only
its requests (a request that goes bad fails alone), errors tell the client nothing local, and 64
concurrent streams (some cancelled) leave the pool idle. Bad requests: test_bad_input.py."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import pytest
from server_helpers import API_KEY, ServerThread, captured_log, scrape

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _post(server: ServerThread, path: str, body: Any) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, headers=AUTH)


def test_other_routes_answer_in_openai_shape(server: ServerThread) -> None:
    r = httpx.get(server.base_url + "/v1/nothing-here", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = httpx.get(server.base_url + "/v1/completions", headers=AUTH)
    assert r.status_code == 405 and r.json()["error"]["message"]
    assert r.headers["allow"] == "POST"  # Starlette's, kept by our error shape


def test_an_unhandled_error_is_a_500_logged_once(server: ServerThread,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Our log line (with the request id the client is given), and not uvicorn's as well."""
    import logging

    def broken(name: str | None) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(server.app.state.server, "check_model", broken)
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    keep = Keep()
    loggers = [logging.getLogger("pagedllm"), logging.getLogger("uvicorn.error")]
    for lg in loggers:
        lg.addHandler(keep)
    try:
        r = _post(server, "/v1/completions", {"prompt": "t5", "max_tokens": 1})
        time.sleep(0.5)  # uvicorn would log after the response is out
    finally:
        for lg in loggers:
            lg.removeHandler(keep)
    assert r.status_code == 500, r.text
    _generic(r.json()["error"]["message"], r.json())
    logged = [x for x in records if x.exc_info and "injected" in str(x.exc_info[1])]
    assert len(logged) == 1, [x.getMessage() for x in logged]
    assert r.json()["error"]["message"].split("request id ")[1].split(")")[0] in logged[0].getMessage()


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
    """The client learns that the engine failed and its request id, nothing of the failure
    itself; the server log has the detail under that id."""
    def break_next_step(engine: Any) -> None:
        real = engine.core.step  # the core's step: the server's core loop drives the core

        def boom() -> Any:
            engine.core.step = real  # fail once, after the scheduler has allocated blocks
            engine.scheduler.schedule()
            raise RuntimeError("injected failure at /home/me/secret.py")

        engine.core.step = boom

    with captured_log() as log:
        server.call(break_next_step)
        r = _post(server, "/v1/completions", {"prompt": "t5 t6", "max_tokens": 5, "temperature": 0})
        assert r.status_code == 500
        err = r.json()["error"]
        _generic(err["message"], r.json())
        assert err["type"] == "server_error" and err["code"] == "engine_error"
        rid = err["message"].split("request id ")[1].split(")")[0]
        assert rid.startswith("cmpl-") and any(rid in m and "injected failure" in m for m in log)
        server.wait_idle()
        server.call(break_next_step)
        with httpx.stream("POST", server.base_url + "/v1/completions", headers=AUTH,
                          json={"prompt": "t5 t6", "max_tokens": 5, "stream": True}) as s:
            events = [line for line in s.iter_lines() if line]
    assert '"error"' in events[0] and "request id cmpl-" in events[0] and events[-1] == "data: [DONE]"
    _generic(events[0], events[0])
    server.wait_idle()
    assert httpx.get(server.base_url + "/health").status_code == 200
    ok = _post(server, "/v1/completions", {"prompt": "t5 t6", "max_tokens": 5, "temperature": 0})
    assert ok.status_code == 200


def _generic(message: str, whole: Any) -> None:
    for local in ("injected", "RuntimeError", "secret", "/home", "pid", "host-a", "site-packages",
                  "WorkerGone", "rank"):
        assert local not in str(whole), (local, whole)
    assert "request id " in message, message


def test_a_request_that_goes_bad_in_flight_fails_alone(server: ServerThread) -> None:
    """Issue #19's out-of-vocab stop id that broke every request in the step: a request whose
    state turns invalid after admission (simulated here, since admission refuses it) gets a 500
    naming only its id; the requests beside it finish exactly as they do alone."""
    bodies = [{"prompt": f"t{5 + i} t9 t{30 + i}", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
              for i in range(5)]
    alone = [_post(server, "/v1/completions", b).json()["choices"][0]["text"] for b in bodies]

    def poison(engine: Any) -> int:
        """Once the victim runs beside all the others, make it invalid; the count poisoned."""
        if len(engine.scheduler.running) < 6:
            return 0
        bad = [r for r in engine.scheduler.running if r.prompt_token_ids == [70, 71]]
        for r in bad:
            r.params = r.params.clone(stop_token_ids=[99999], min_tokens=120)
        return len(bad)

    async def run() -> tuple[list[httpx.Response], httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=60) as client:
            victim = asyncio.ensure_future(client.post("/v1/completions", json={
                "prompt": "t70 t71", "max_tokens": 120, "temperature": 0, "ignore_eos": True}))
            others = [asyncio.ensure_future(client.post("/v1/completions", json=b)) for b in bodies]
            deadline = time.monotonic() + 20
            while not await asyncio.to_thread(server.call, poison):
                assert time.monotonic() < deadline and not victim.done()
            return list(await asyncio.gather(*others)), await victim

    others, victim = asyncio.run(run())
    assert victim.status_code == 500, victim.text
    _generic(victim.json()["error"]["message"], victim.json())
    assert [r.json()["choices"][0]["text"] for r in others] == alone
    server.wait_idle()


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
                raise WorkerGone("rank 1 (pid 4242 on host-a) exited: see /opt/site-packages/torch/x.py")

            engine.core.step = boom

        server.call(break_for_good)
        with captured_log() as log:
            r = _post(server, "/v1/completions", {"prompt": "t5 t6", "max_tokens": 5})
        assert r.status_code == 500
        _generic(r.json()["error"]["message"], r.json())
        assert any("pid 4242 on host-a" in m for m in log)
        assert httpx.get(server.base_url + "/health").status_code == 503
        again = _post(server, "/v1/completions", {"prompt": "t5 t6", "max_tokens": 5})
        assert again.status_code == 503
        _generic(again.json()["error"]["message"], again.json())


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
