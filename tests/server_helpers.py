"""Helpers for the server tests: the in-process uvicorn server thread and a /metrics scraper."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

API_KEY = "sk-test-key"
# word-level tokenizer: every message becomes its words, then "t4" opens the assistant turn
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}t4{% endif %}"
)


class ServerThread:
    """uvicorn.Server on a pre-bound 127.0.0.1 socket in a daemon thread."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()

    # -- engine introspection, run on the engine thread between steps ----------------------------
    def call(self, fn: Any) -> Any:
        return self.app.state.async_engine.call_sync(fn)

    def wait_idle(self, timeout: float = 20.0) -> None:
        """Until no request is in flight; then every KV block must be back in the pool."""
        deadline = time.monotonic() + timeout
        while self.call(lambda e: e.has_unfinished_requests()):
            if time.monotonic() > deadline:
                raise AssertionError("requests still in flight")
            time.sleep(0.05)

        def check(e: Any) -> tuple[int, int]:
            e.check_integrity()
            return e.kv.num_free_blocks, e.kv.num_blocks

        free, total = self.call(check)
        assert free == total, f"{total - free} KV blocks still held"


def scrape(server: ServerThread) -> dict[str, float]:
    """/metrics as {name: value summed over labels}."""
    text = httpx.get(server.base_url + "/metrics").text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{", 1)[0]
        values[name] = values.get(name, 0.0) + float(value)
    return values


@contextmanager
def captured_log() -> Iterator[list[str]]:
    """What the ``pagedllm`` loggers write meanwhile (messages with their tracebacks)."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(self.format(record))

    handler = Keep()
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger("pagedllm")
    root.addHandler(handler)
    try:
        yield lines
    finally:
        root.removeHandler(handler)
