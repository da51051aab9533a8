"""A data-parallel replica as a Ray actor (``--data-parallel-backend ray``): the engine core runs
in an actor that Ray places on any node of the cluster with the CPUs (and GPUs) it asks for;
its messages travel as Ray actor calls and their object refs, no other transport::

    front end (RayLink)                                 RayCoreActor (a thread runs serve_core)
    ───────────────────                                 ────────────────────────────────────────
    send(msg) ─▶ actor.send.remote(seq, msgpack) ──────▶ in order by seq ─▶ inbox ─▶ CoreLoop
    reader:   await actor.recv.remote(POLL_S) ◀──────── outbox (every message the core sent)
              ◀─ ([msgpack, ...], loop_ended)

A threaded actor runs its calls concurrently (``recv`` waits while ``send`` calls come in),
and Ray does not keep their order then: each ``send`` carries a sequence number and the actor
applies them in that order. The reader holds one ``recv`` in flight: it returns as soon as the
core said something, or after ``POLL_S`` of silence. A dead actor fails that call
(``RayActorError``): ``exit_cause`` names it, and the client takes the replica out of routing.

The front end joins the cluster named by ``RAY_ADDRESS`` (``ray start --head`` on one node,
``ray start --address HEAD:6379`` on the others) or an already initialised Ray, else starts a
local instance, as the Ray executor of tensor parallelism does.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

from pagedllm.distributed.ray_init import join_ray
from pagedllm.engine.client import EngineUnavailable
from pagedllm.engine.core_link import Deliver
from pagedllm.engine.core_proc import CoreOptions, QueueTransport, serve_core
from pagedllm.engine.messages import (
    CoreDead,
    Ready,
    Shutdown,
    ToCore,
    encoder,
    from_core_decoder,
    to_core_decoder,
)
from pagedllm.logging_utils import init_logger

if TYPE_CHECKING:
    from pagedllm.args import EngineArgs

logger = init_logger(__name__)

POLL_S = 1.0  # longest a recv call waits in the actor for the core to say something
START_WARN_S = 30.0  # a replica not built by then: log that it waits (for Ray to place it?)


class RayCoreActor:
    """The actor's class body (wrapped with ``ray.remote`` when a link starts): the core's loop
    in a thread, a queue each way."""

    def __init__(self, engine_args: EngineArgs, options: CoreOptions) -> None:
        self._outbox: queue.Queue[bytes | None] = queue.Queue()
        enc = encoder()
        self._transport = QueueTransport(lambda msg: self._outbox.put(enc.encode(msg)))
        self._dec = to_core_decoder()
        self._lock = threading.Lock()
        self._next = 1
        self._early: dict[int, bytes] = {}
        threading.Thread(target=self._run, args=(engine_args, options),
                         name="pagedllm-engine-core", daemon=True).start()

    def _run(self, engine_args: EngineArgs, options: CoreOptions) -> None:
        try:
            serve_core(engine_args, self._transport, options, lambda: True, os.getpid())
        finally:
            self._outbox.put(None)  # the loop ended: recv says so

    def send(self, seq: int, payload: bytes) -> None:
        """Message ``seq`` (from 1) of the front end; applied in sequence order."""
        with self._lock:
            self._early[seq] = payload
            while self._next in self._early:
                self._transport.inbox.put(self._dec.decode(self._early.pop(self._next)))
                self._next += 1

    def recv(self, timeout_s: float) -> tuple[list[bytes], bool]:
        """What the core sent since the last call (waiting up to ``timeout_s`` for the first);
        True once the core's loop has ended (nothing more will come)."""
        try:
            item = self._outbox.get(timeout=timeout_s)
        except queue.Empty:
            return [], False
        frames: list[bytes] = []
        while item is not None:
            frames.append(item)
            try:
                item = self._outbox.get_nowait()
            except queue.Empty:
                return frames, False
        return frames, True

    def where(self) -> tuple[str, int]:
        import ray

        return str(ray.util.get_node_ip_address()), os.getpid()


class RayLink:
    """One replica's engine core in a Ray actor (``CoreLink``). The actor reserves
    ``options.num_threads`` CPUs (1 if unset) and ``num_gpus`` GPUs."""

    def __init__(self, engine_args: EngineArgs, options: CoreOptions) -> None:
        self.engine_args = engine_args
        self.options = options
        self.num_gpus = 0 if engine_args.device == "cpu" else engine_args.tensor_parallel_size
        self.actor: Any = None
        self.node: str | None = None
        self.pid: int | None = None
        self._seq = 0
        self._enc, self._dec = encoder(), from_core_decoder()
        self._reader: asyncio.Task[None] | None = None
        self._cause: str | None = None

    def describe(self) -> str:
        where = f"pid {self.pid} on {self.node}" if self.pid is not None else "not placed yet"
        return f"the Ray actor of engine replica {self.options.data_parallel_rank} ({where})"

    async def start(self, deliver: Deliver) -> Ready:
        import ray

        join_ray(log_to_driver=True)
        cls = ray.remote(num_cpus=self.options.num_threads or 1,  # type: ignore[call-overload]
                         num_gpus=self.num_gpus, max_concurrency=4)(RayCoreActor)
        self.actor = cls.remote(self.engine_args, self.options)  # type: ignore[attr-defined]
        ready: Ready | None = None
        t0, warned = time.monotonic(), False
        while ready is None:
            try:
                frames, ended = await self.actor.recv.remote(POLL_S)
            except Exception as e:  # noqa: BLE001 - the actor could not be built or died
                raise RuntimeError(f"{self.describe()} failed to start: {e}") from e
            msgs = [self._dec.decode(f) for f in frames]
            for msg in msgs:
                if isinstance(msg, CoreDead):
                    raise RuntimeError(f"the engine core failed to start: {msg.reason}")
            ready = next((m for m in msgs if isinstance(m, Ready)), None)
            if ready is None and ended:
                raise RuntimeError(f"{self.describe()} ended before its engine was ready")
            if ready is None and not warned and time.monotonic() - t0 > START_WARN_S:
                warned = True
                logger.warning("%s is not ready after %.0f s; does the Ray cluster have %d "
                               "free CPUs and %d GPUs for it?", self.describe(), START_WARN_S,
                               self.options.num_threads or 1, self.num_gpus)
        self.node, self.pid = await self.actor.where.remote()
        logger.info("%s is serving", self.describe())
        self._reader = asyncio.ensure_future(self._read(deliver))
        return ready

    async def _read(self, deliver: Deliver) -> None:
        while True:
            try:
                frames, ended = await self.actor.recv.remote(POLL_S)
            except Exception as e:  # noqa: BLE001 - RayActorError: the actor is gone
                self._cause = f"{self.describe()} died ({type(e).__name__})"
                return
            for f in frames:
                deliver(self._dec.decode(f))
            if ended:
                self._cause = f"{self.describe()} ended its engine loop"
                return

    def send(self, msg: ToCore) -> None:
        if self._cause is not None or self.actor is None:
            raise EngineUnavailable(f"cannot reach {self.describe()}: {self._cause or 'not started'}")
        self._seq += 1
        self.actor.send.remote(self._seq, self._enc.encode(msg))

    def exit_cause(self) -> str | None:
        return self._cause

    def kill(self) -> None:
        """Kill the actor (tests: a replica that dies)."""
        import ray

        ray.kill(self.actor)

    async def stop(self, timeout: float) -> None:
        """``Shutdown``, wait up to ``timeout`` for the core's last messages, kill the actor."""
        if self.actor is None:
            return
        import ray

        if self._cause is None:
            self.send(Shutdown())
        if self._reader is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._reader), timeout)
            except asyncio.TimeoutError:
                logger.warning("%s did not stop within %.0f s; killing it", self.describe(),
                               timeout)
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        ray.kill(self.actor)
        self._cause = self._cause or "stopped"
