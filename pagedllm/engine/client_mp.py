"""``MPClient``: the engine core in its own process (``pagedllm serve``), over two ZMQ PUSH/PULL
sockets (``core_link.ProcessLink``); the model's steps never hold the GIL of the process that
serves HTTP. The core's death is seen within ``WATCH_S``: ``is_running`` turns False
(``/health`` 503) and every stream ends with an ``EngineError`` naming the cause."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from pagedllm._malloc import IdleRelease
from pagedllm.config import EngineConfig
from pagedllm.engine.client import EngineClient, FrontEnd, ServerShuttingDown
from pagedllm.engine.core_link import WATCH_S, ProcessLink
from pagedllm.engine.core_proc import BURST_GAP_MS, CoreOptions
from pagedllm.engine.messages import ToCore
from pagedllm.sched.stats import StepStats

if TYPE_CHECKING:
    import multiprocessing.process

    from pagedllm.args import EngineArgs

__all__ = ["WATCH_S", "FrontEndIdle", "MPClient"]


class FrontEndIdle:
    """The front end tokenizes (a 1 MB prompt is ~20 MiB of token ids) and holds request
    bodies; like the core's loop, it gives what a burst freed back once idle. ``tick`` runs
    every ``WATCH_S`` on the client's watch task."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self.release = IdleRelease()
        self._epoch, self._last_work = client.activity.epoch, time.monotonic()

    async def tick(self) -> None:
        c = self.client  # HTTP bodies and tokenizer jobs free their memory when they END
        if not c.is_idle() or c.activity.in_flight or self._epoch != c.activity.epoch:
            self._epoch, self._last_work = c.activity.epoch, time.monotonic()
            self.release.worked()
        elif (self.release.wait_s is not None
              and time.monotonic() - self._last_work >= self.release.after_s):
            await asyncio.to_thread(self.release.idle)  # once per idle spell


class MPClient(EngineClient):
    """The engine core in its own process (``ProcessLink``)."""

    def __init__(self, engine_args: EngineArgs, config: EngineConfig | None = None,
                 batch_wait_ms: float = 0.0, num_threads: int | None = None,
                 burst_gap_ms: float = BURST_GAP_MS, prefill_threads: int | None = None) -> None:
        if batch_wait_ms < 0 or burst_gap_ms < 0:
            raise ValueError(f"batch_wait_ms={batch_wait_ms} and burst_gap_ms={burst_gap_ms} "
                             "must be >= 0")
        config = config or engine_args.create_engine_config()
        super().__init__(FrontEnd(config), StepStats())
        self.engine_args = engine_args
        self.batch_wait_ms = batch_wait_ms
        self.link = ProcessLink(engine_args, CoreOptions(batch_wait_ms, num_threads,
                                                           burst_gap_ms=burst_gap_ms,
                                                           prefill_threads=prefill_threads))
        self._started = False
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self.idle = FrontEndIdle(self)

    @property
    def proc(self) -> multiprocessing.process.BaseProcess | None:
        return self.link.proc

    async def start(self) -> None:
        """Start the core process and wait until its engine is built (weights loaded, KV pool
        allocated). Raises RuntimeError if it failed to start (the log says why)."""
        if self._started:
            return
        self._started = True
        self._loop = asyncio.get_running_loop()
        ready = await self.link.start(self._dispatch)
        self.stats = ready.stats
        self._tasks = [asyncio.ensure_future(self._watch())]

    def _send(self, msg: ToCore) -> None:
        self.link.send(msg)

    async def _watch(self) -> None:
        """The core process's death, seen within ``WATCH_S``: health goes down, every stream
        ends with an error naming the cause."""
        cause = await watch_link(self.link.exit_cause, self.idle.tick)
        if not self._stopping or self._streams:
            self._on_dead(cause)

    @property
    def is_running(self) -> bool:
        return (self._started and self.link.exit_cause() is None and self.dead is None
                and not self._stopping)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the core to end what is in flight and exit; kill it after ``timeout``."""
        if not self._started or self._stopping:
            return
        self._stopping = True
        await self.link.stop(timeout)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._fail_local(ServerShuttingDown("the server is shutting down"))
        self._tokenizer_thread.shutdown(wait=False)


async def watch_link(exit_cause: Callable[[], str | None],
                     tick: Callable[[], Awaitable[None]] | None = None) -> str:
    """Wait until ``exit_cause()`` names why a core is gone (``tick`` awaited every
    ``WATCH_S`` meanwhile); its last messages (``CoreDead``) get ``WATCH_S`` to arrive first."""
    while (cause := exit_cause()) is None:
        await asyncio.sleep(WATCH_S)
        if tick is not None:
            await tick()
    await asyncio.sleep(WATCH_S)
    return cause
