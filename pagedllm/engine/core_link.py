"""A link to one engine core: messages out, messages in, and whether the core still lives.

An ``EngineClient`` owns the front end's work (tokenizing, streams, detokenizing); a link only
moves its messages. ``MPClient`` holds one ``ProcessLink``; the data-parallel client
(``router.client.DPClient``) holds one per replica, a ``ProcessLink`` or a Ray actor's
``router.ray_link.RayLink``: both have this shape::

    link.start(deliver) ─▶ Ready          the core built its engine (RuntimeError: it could not)
    link.send(msg)                        never blocks (EngineUnavailable: cannot reach the core)
    deliver(msg)                          every later message, called on the event loop
    link.exit_cause() ─▶ None | "why"     None while the core can serve
    link.stop(timeout)                    Shutdown, wait, kill; its last messages delivered
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from pagedllm.engine.client import EngineUnavailable
from pagedllm.engine.core_proc import CoreOptions
from pagedllm.engine.messages import CoreDead, FromCore, Ready, Shutdown, ToCore
from pagedllm.logging_utils import init_logger

if TYPE_CHECKING:
    import multiprocessing.process

    from pagedllm.args import EngineArgs

logger = init_logger(__name__)

WATCH_S = 0.1  # how often a front end looks whether its core is alive
Deliver = Callable[[FromCore], None]


class CoreLink(Protocol):
    def describe(self) -> str:
        """The core for a log line ("the engine core process (pid N)")."""

    async def start(self, deliver: Deliver) -> Ready: ...

    def send(self, msg: ToCore) -> None: ...

    def exit_cause(self) -> str | None: ...

    async def stop(self, timeout: float) -> None: ...


class ProcessLink:
    """The engine core in its own process (spawned: CUDA and torch threads do not survive a
    fork), over two ZMQ PUSH/PULL sockets on IPC paths in a private temporary directory."""

    def __init__(self, engine_args: EngineArgs, options: CoreOptions,
                 name: str = "pagedllm-engine-core") -> None:
        self.engine_args = engine_args
        self.options = options
        self.name = name
        self.proc: multiprocessing.process.BaseProcess | None = None
        self._dir: str | None = None
        self._ctx: Any = None
        self._push: Any = None
        self._pull: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._deliver: Deliver | None = None

    def describe(self) -> str:
        return f"the engine core process (pid {self.proc.pid if self.proc else '?'})"

    async def start(self, deliver: Deliver) -> Ready:
        """Start the core process and wait until its engine is built (weights loaded, KV pool
        allocated). Raises RuntimeError if it failed to start (the log says why)."""
        import multiprocessing

        import zmq
        import zmq.asyncio

        from pagedllm.engine.core_proc import run_core_process
        from pagedllm.engine.messages import encoder, from_core_decoder

        assert self.proc is None, "started twice"
        self._deliver = deliver
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
            target=run_core_process, name=self.name,
            args=(self.engine_args, in_addr, out_addr, self.options, os.getpid()))
        self.proc.start()
        logger.info("engine core process started (pid %d)", self.proc.pid)
        while True:  # the engine's build has no fixed bound (weights, TP workers): wait for it
            if await self._pull.poll(int(WATCH_S * 1000)):
                msg = self._dec.decode(await self._pull.recv())
                if isinstance(msg, Ready):
                    break
                if isinstance(msg, CoreDead):
                    await self._close_after_failed_start()
                    raise RuntimeError(f"the engine core failed to start: {msg.reason}")
            elif not self.proc.is_alive():
                why = exit_cause(self.proc.exitcode)
                await self._close_after_failed_start()
                raise RuntimeError(f"the engine core process failed to start ({why}); the log "
                                   "above has the details")
        self._reader = asyncio.ensure_future(self._read())
        return msg

    async def _close_after_failed_start(self) -> None:
        assert self.proc is not None
        await asyncio.to_thread(self.proc.join, 10)
        self._close()

    def send(self, msg: ToCore) -> None:
        import zmq

        if self._push is None:
            raise EngineUnavailable("the engine core's link is closed")
        try:  # unlimited HWM: a send never blocks (a dead core's pipe only queues)
            self._push.send(self._enc.encode(msg), flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as e:
            raise EngineUnavailable(f"could not send to the engine core: {e}") from e

    async def _read(self) -> None:
        assert self._deliver is not None
        while True:
            frame = await self._pull.recv(copy=False)
            self._deliver(self._dec.decode(frame.buffer))

    def exit_cause(self) -> str | None:
        if self.proc is None or self.proc.is_alive():
            return None
        return f"{self.describe()} {exit_cause(self.proc.exitcode)}"

    def kill(self) -> None:
        """SIGKILL the core (tests: a replica that dies)."""
        if self.proc is not None and self.proc.pid is not None:
            os.kill(self.proc.pid, signal.SIGKILL)

    async def stop(self, timeout: float) -> None:
        """Ask the core to end what is in flight and exit; kill it after ``timeout``. Its last
        messages are delivered before this returns."""
        if self.proc is None:
            return
        if self.proc.is_alive():
            try:
                self.send(Shutdown())
            except EngineUnavailable:
                pass
            await asyncio.to_thread(self.proc.join, timeout)
        if self.proc.is_alive():
            logger.warning("the engine core did not stop within %.0f s; killing it", timeout)
            self.proc.kill()
            await asyncio.to_thread(self.proc.join, 5)
        assert self._deliver is not None
        while self._pull is not None and await self._pull.poll(50):  # its last outputs
            self._deliver(self._dec.decode(await self._pull.recv()))
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self._close()

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


def exit_cause(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"
