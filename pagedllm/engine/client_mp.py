"""``MPClient``: the engine core in its own process (``pagedllm serve``), over two ZMQ PUSH/PULL
sockets; the model's steps never hold the GIL of the process that serves HTTP. The core's death
is seen within ``WATCH_S``: ``is_running`` turns False (``/health`` 503) and every stream ends
with an ``EngineError`` naming the cause."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
import time
from typing import TYPE_CHECKING, Any

from pagedllm._malloc import IdleRelease
from pagedllm.config import EngineConfig
from pagedllm.engine.client import EngineClient, EngineUnavailable, FrontEnd, ServerShuttingDown
from pagedllm.engine.messages import CoreDead, Ready, Shutdown, ToCore
from pagedllm.logging_utils import init_logger
from pagedllm.sched.stats import StepStats

if TYPE_CHECKING:
    import multiprocessing.process

    from pagedllm.args import EngineArgs

logger = init_logger(__name__)

WATCH_S = 0.1  # how often the front end looks whether the core process is alive


class MPClient(EngineClient):
    """The engine core in its own process (spawned: CUDA and torch threads do not survive a
    fork), over two ZMQ PUSH/PULL sockets on IPC paths in a private temporary directory."""

    def __init__(self, engine_args: EngineArgs, config: EngineConfig | None = None,
                 batch_wait_ms: float = 0.0) -> None:
        if batch_wait_ms < 0:
            raise ValueError(f"batch_wait_ms={batch_wait_ms} must be >= 0")
        config = config or engine_args.create_engine_config()
        super().__init__(FrontEnd(config), StepStats())
        self.engine_args = engine_args
        self.batch_wait_ms = batch_wait_ms
        self.proc: multiprocessing.process.BaseProcess | None = None
        self._dir: str | None = None
        self._ctx: Any = None
        self._push: Any = None
        self._pull: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        # The front end tokenizes (a 1 MB prompt is ~20 MiB of token ids) and holds request
        # bodies; like the core's loop, it gives what a burst freed back once idle.
        self.idle_release = IdleRelease()

    async def start(self) -> None:
        """Start the core process and wait until its engine is built (weights loaded, KV pool
        allocated). Raises RuntimeError if it failed to start (the log says why)."""
        import multiprocessing

        import zmq
        import zmq.asyncio

        from pagedllm.engine.core_proc import run_core_process
        from pagedllm.engine.messages import encoder, from_core_decoder

        if self.proc is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._dir = tempfile.mkdtemp(prefix="pagedllm-core-")
        in_addr, out_addr = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._ctx = zmq.asyncio.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on a send
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.bind(in_addr)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(out_addr)
        self._enc, self._dec = encoder(), from_core_decoder()
        self.proc = multiprocessing.get_context("spawn").Process(
            target=run_core_process, name="pagedllm-engine-core",
            args=(self.engine_args, in_addr, out_addr, self.batch_wait_ms, os.getpid()))
        self.proc.start()
        logger.info("engine core process started (pid %d)", self.proc.pid)
        while True:  # the engine's build has no fixed bound (weights, TP workers): wait for it
            if await self._pull.poll(int(WATCH_S * 1000)):
                msg = self._dec.decode(await self._pull.recv())
                if isinstance(msg, Ready):
                    self.stats = msg.stats
                    break
                if isinstance(msg, CoreDead):
                    await self._close_after_failed_start()
                    raise RuntimeError(f"the engine core failed to start: {msg.reason}")
            elif not self.proc.is_alive():
                why = _exit_cause(self.proc.exitcode)
                await self._close_after_failed_start()
                raise RuntimeError(f"the engine core process failed to start ({why}); the log "
                                   "above has the details")
        self._tasks = [asyncio.ensure_future(self._read()), asyncio.ensure_future(self._watch())]

    async def _close_after_failed_start(self) -> None:
        assert self.proc is not None
        await asyncio.to_thread(self.proc.join, 10)
        self._close()

    def _send(self, msg: ToCore) -> None:
        import zmq

        try:  # unlimited HWM: a send never blocks (a dead core's pipe only queues)
            self._push.send(self._enc.encode(msg), flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as e:
            raise EngineUnavailable(f"could not send to the engine core: {e}") from e

    async def _read(self) -> None:
        while True:
            frame = await self._pull.recv(copy=False)
            self._dispatch(self._dec.decode(frame.buffer))

    async def _watch(self) -> None:
        """The core process's death, seen within ``WATCH_S``: health goes down, every stream
        ends with an error naming the cause."""
        assert self.proc is not None
        epoch, last_work = self.activity.epoch, time.monotonic()
        while self.proc.is_alive():
            await asyncio.sleep(WATCH_S)
            if not self.is_idle() or self.activity.in_flight or epoch != self.activity.epoch:
                epoch, last_work = self.activity.epoch, time.monotonic()
                self.idle_release.worked()
            elif (self.idle_release.wait_s is not None
                  and time.monotonic() - last_work >= self.idle_release.after_s):
                await asyncio.to_thread(self.idle_release.idle)  # once per idle spell
        await asyncio.sleep(WATCH_S)  # its last messages (CoreDead) first, if it sent any
        if not self._stopping or self._streams:
            self._on_dead(f"the engine core process (pid {self.proc.pid}) "
                          f"{_exit_cause(self.proc.exitcode)}")

    @property
    def is_running(self) -> bool:
        return (self.proc is not None and self.proc.is_alive() and self.dead is None
                and not self._stopping)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the core to end what is in flight and exit; kill it after ``timeout``."""
        if self.proc is None or self._stopping:
            return
        self._stopping = True
        if self.proc.is_alive():
            try:
                self._send(Shutdown())
            except EngineUnavailable:
                pass
            await asyncio.to_thread(self.proc.join, timeout)
        if self.proc.is_alive():
            logger.warning("the engine core did not stop within %.0f s; killing it", timeout)
            self.proc.kill()
            await asyncio.to_thread(self.proc.join, 5)
        while self._pull is not None and await self._pull.poll(50):  # its last outputs
            self._dispatch(self._dec.decode(await self._pull.recv()))
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._fail_local(ServerShuttingDown("the server is shutting down"))
        self._close()
        self._tokenizer_thread.shutdown(wait=False)

    def _close(self) -> None:
        for sock in (self._push, self._pull):
            if sock is not None:
                sock.close(0)
        self._push = self._pull = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def _exit_cause(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"
