"""``InProcessClient``: the engine core loop in a thread of this process (tests, ``LLM``-style
use, ``pagedllm serve --engine-in-process``), with the same messages as ``MPClient``, not
encoded."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedllm.engine.client import EngineClient, FrontEnd, ServerShuttingDown
from pagedllm.engine.core_proc import CoreLoop, CoreService, QueueTransport
from pagedllm.engine.messages import FromCore, Shutdown, ToCore

if TYPE_CHECKING:
    from pagedllm.engine.core import LLMEngine


class InProcessClient(EngineClient):
    """The core loop in a thread of this process: the same messages, not encoded."""

    def __init__(self, engine: LLMEngine, batch_wait_ms: float = 0.0) -> None:
        if batch_wait_ms < 0:
            raise ValueError(f"batch_wait_ms={batch_wait_ms} must be >= 0")
        super().__init__(FrontEnd(engine.config, engine.structured.compiler), engine.stats)
        self.engine = engine  # tests' introspection (call_sync) only
        self.batch_wait_s = batch_wait_ms / 1000.0
        self._core_loop: CoreLoop | None = None
        self._transport: _TestableQueue | None = None
        self._thread: threading.Thread | None = None

    @property
    def num_steps(self) -> int:
        return self._core_loop.num_steps if self._core_loop is not None else 0

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._transport = _TestableQueue(self._deliver, self.engine)
        self._core_loop = CoreLoop(CoreService(self.engine.core), self._transport, self.batch_wait_s)
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        assert self._core_loop is not None
        try:
            self._core_loop.run()
        except BaseException:  # noqa: BLE001 - CoreDead was sent and logged by the loop
            pass

    def _deliver(self, msg: FromCore) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._dispatch, msg)
            except RuntimeError:  # the loop closed meanwhile: nobody is listening
                pass

    def _send(self, msg: ToCore) -> None:
        assert self._transport is not None, "start() the client first"
        self._transport.inbox.put(msg)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead is None

    async def shutdown(self, timeout: float = 10.0) -> None:
        """End what is in flight (``ServerShuttingDown``) and stop the core thread."""
        if self._thread is None:
            return
        self._send(Shutdown())
        await asyncio.to_thread(self._thread.join, timeout)
        await asyncio.sleep(0)  # the core's last outputs, queued by call_soon_threadsafe
        self._thread = None
        self._fail_local(ServerShuttingDown("the server is shutting down"))
        self.engine.shutdown()  # stops tensor-parallel workers; a no-op in one process
        self._tokenizer_thread.shutdown(wait=False)

    def call_sync(self, fn: Callable[[LLMEngine], Any], timeout: float | None = 30.0) -> Any:
        """Tests only: run ``fn(engine)`` on the core thread between steps and return its result
        (do not call from the event loop). The server uses named ``utility`` calls."""
        assert self._transport is not None, "start() the client first"
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._transport.inbox.put(_TestCall(fn, fut))  # type: ignore[arg-type]
        return fut.result(timeout)


@dataclass
class _TestCall:
    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future[Any]


class _TestableQueue(QueueTransport):
    """Runs ``_TestCall``s where it takes messages: on the core thread, between steps."""

    def __init__(self, deliver: Callable[[FromCore], None], engine: LLMEngine) -> None:
        super().__init__(deliver)
        self.engine = engine

    def recv(self, timeout_s: float | None) -> ToCore | None:
        while True:
            msg = super().recv(timeout_s)
            if not isinstance(msg, _TestCall):
                return msg
            try:
                msg.future.set_result(msg.fn(self.engine))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                msg.future.set_exception(e)
