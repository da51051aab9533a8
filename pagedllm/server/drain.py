"""SIGTERM for ``pagedllm serve``: a drain that ends every request cleanly.

uvicorn stops accepting connections and waits for those in flight; when its own graceful-shutdown
timeout passes it cancels the request tasks, and clients get a plain-text 500 or a stream cut
mid-chunk. Here the app's own deadline comes first: after ``--drain-timeout`` seconds the
requests still in flight are ended by the engine with ``ServerShuttingDown`` — a 503 JSON body for
a non-streamed request, a final error event and ``[DONE]`` on a stream — so the connections close
by themselves, and uvicorn's timeout (``DRAIN_GRACE`` later) is only a backstop.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import uvicorn
from fastapi import FastAPI

from pagedllm.engine.client import ServerShuttingDown
from pagedllm.logging_utils import init_logger

logger = init_logger(__name__)

DRAIN_GRACE = 5.0  # seconds uvicorn waits after the drain deadline before it cancels tasks


class DrainingServer(uvicorn.Server):
    def __init__(self, app: FastAPI, drain_timeout: float, **config: Any) -> None:
        """``config``: uvicorn.Config's keywords (host, port, log_level)."""
        grace = drain_timeout + DRAIN_GRACE
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=grace, **config))  # type: ignore[arg-type]  # a float works
        self.async_engine = app.state.async_engine
        self.drain_timeout = drain_timeout

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        deadline = asyncio.ensure_future(self._deadline())
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    async def _deadline(self) -> None:
        await asyncio.sleep(self.drain_timeout)
        logger.warning("--drain-timeout %.1f s passed: ending the requests still in flight with 503",
                       self.drain_timeout)
        self.async_engine.fail_in_flight(ServerShuttingDown(
            f"--drain-timeout {self.drain_timeout} s passed during shutdown"))
