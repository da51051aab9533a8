"""``pagedllm serve`` with its engine core in its own process: what a client sees when the core
is SIGKILLed under load (health down within 5 s, every stream ended by an error event within
10 s, the server log naming the cause), and that a client that goes away aborts in the core."""

from __future__ import annotations

import io
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from serve_process import REPO, child_pids, pid_alive

from pagedllm.bench.server_process import serve_subprocess

ARGS = ["--block-size", "4", "--num-kv-blocks", "512", "--max-model-len", "512", "--max-num-seqs", "64"]
BODY = {"prompt": "t5 t6", "max_tokens": 480, "ignore_eos": True, "stream": True}


def _core_pid(server_pid: int) -> int:
    """The spawned child (not multiprocessing's resource tracker)."""
    kids = [p for p in child_pids(server_pid)
            if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(kids) == 1, f"engine core processes under {server_pid}: {kids}"
    return kids[0]


def _metric(base: str, name: str) -> float:
    for line in httpx.get(base + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.mark.slow
def test_sigkill_of_the_core_under_load(chat_model: Path) -> None:
    log = io.StringIO()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with serve_subprocess([str(chat_model), *ARGS], log=log, env=env) as (proc, base):
        core = _core_pid(proc.pid)
        ends: list[str] = []
        first = threading.Semaphore(0)

        def stream() -> None:
            events: list[str] = []
            try:
                with httpx.stream("POST", base + "/v1/completions", json=BODY, timeout=60) as s:
                    for line in s.iter_lines():
                        if line:
                            if not events:
                                first.release()
                            events.append(line)
            except httpx.TransportError as e:
                ends.append(f"cut: {e!r}")
                return
            last = json.loads(events[-2][len("data: "):]) if len(events) >= 2 else {}
            kind = "error event" if "error" in last and events[-1] == "data: [DONE]" else f"other: {events[-2:]}"
            ends.append(kind)

        threads = [threading.Thread(target=stream, daemon=True) for _ in range(16)]
        for t in threads:
            t.start()
        for _ in threads:  # every stream is running
            assert first.acquire(timeout=60)
        os.kill(core, signal.SIGKILL)
        health_by, streams_by = time.monotonic() + 5, time.monotonic() + 10
        while httpx.get(base + "/health", timeout=5).status_code == 200:
            assert time.monotonic() < health_by, "/health still 200 5 s after the core died"
            time.sleep(0.05)
        for t in threads:
            t.join(max(0.0, streams_by - time.monotonic()))
        assert len(ends) == 16, f"{16 - len(ends)} streams still open 10 s after the core died"
        assert all(kind == "error event" for kind in ends), ends
        # new requests are refused at once, not queued forever
        r = httpx.post(base + "/v1/completions", json={**BODY, "stream": False}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    text = log.getvalue()
    assert "engine core process" in text and "SIGKILL" in text, text[-2000:]


@pytest.mark.slow
def test_disconnect_aborts_in_the_core_and_sigterm_stops_both(chat_model: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with serve_subprocess([str(chat_model), *ARGS], env=env) as (proc, base):
        core = _core_pid(proc.pid)
        # 7 long requests keep the core busy while an eighth streams and goes away after its
        # first chunk; once all is quiet the core produced 7 x 480 tokens and fewer than 480 for
        # the one that left (without the abort reaching the core, it would be 8 x 480)
        others = [threading.Thread(target=httpx.post, daemon=True, kwargs=dict(
            url=base + "/v1/completions", json={**BODY, "stream": False}, timeout=120))
            for _ in range(7)]
        for t in others:
            t.start()
        with httpx.stream("POST", base + "/v1/completions", json=BODY, timeout=60) as s:
            next(s.iter_lines())
        for t in others:
            t.join(120)
        deadline = time.monotonic() + 10  # the core aborts it, the blocks return
        while _metric(base, "pagedllm:num_requests_running") or _metric(base, "pagedllm:kv_cache_usage_perc"):
            assert time.monotonic() < deadline, "the core still runs the request of a gone client"
            time.sleep(0.05)
        tokens = _metric(base, "pagedllm:generation_tokens_total")
        assert 7 * 480 < tokens < 8 * 480, tokens
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while pid_alive(core):
            assert time.monotonic() < deadline, "the engine core outlived the server"
            time.sleep(0.05)
