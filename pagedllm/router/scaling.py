"""Elastic data parallelism: ``DPClient.add_replica`` / ``remove_replica`` / ``scale`` (vLLM's
``/scale_elastic_ep``), while serving. A mixin of ``DPClient``: it uses the client's replicas,
routes and links."""

from __future__ import annotations

import asyncio
import time
from functools import partial
from typing import TYPE_CHECKING, Any

from pagedllm.engine.client import EngineError
from pagedllm.logging_utils import init_logger
from pagedllm.router.aggregate import merge_stats
from pagedllm.router.replica import Replica

if TYPE_CHECKING:
    from pagedllm.engine.core_link import CoreLink

logger = init_logger(__name__)


class ElasticReplicas:
    replicas: list[Replica]
    _scaling: asyncio.Lock
    _loras: dict[str, tuple[tuple[Any, ...], tuple | None]]
    _tasks: list[asyncio.Task[None]]

    if TYPE_CHECKING:  # the host class's (router/client.py DPClient)
        @property
        def routable(self) -> list[Replica]: ...

        @property
        def live(self) -> list[Replica]: ...

        def _check_running(self) -> None: ...
        def _link(self, i: int) -> CoreLink: ...
        def _from_replica(self, i: int, msg: Any) -> None: ...
        async def _watch(self, r: Replica) -> None: ...
        async def replica_utility(self, i: int, name: str, *args: Any) -> Any: ...
        def _leave(self, i: int, cause: str, error: EngineError) -> tuple[int, int]: ...

    async def add_replica(self) -> int:
        """Start one more replica, load the adapters served into it and put it in routing; its
        index (indices are never reused). RuntimeError if it fails to start: nothing changed."""
        self._check_running()
        async with self._scaling:
            r = Replica(len(self.replicas), self._link(len(self.replicas)))
            r.dead, r.draining = "starting", True  # heard only once started, routed once ready
            self.replicas.append(r)
            try:
                ready = await r.link.start(partial(self._from_replica, r.index))
                r.stats, r.dead = ready.stats, None
                for args, _ in list(self._loras.values()):
                    await self.replica_utility(r.index, "add_lora", *args)
            except BaseException as e:
                r.dead, r.removed = f"failed to start: {e}", True
                await r.link.stop(5)
                raise RuntimeError(f"engine replica {r.index} failed to start: {e}") from e
            r.draining = False
            self._tasks.append(asyncio.ensure_future(self._watch(r)))
            logger.info("engine replica %d added; %d serving", r.index, len(self.routable))
            return r.index

    async def scale(self, size: int, drain_timeout: float = 120.0) -> None:
        """Add replicas, or drain and remove the newest ones, until ``size`` serve."""
        if size < 1:
            raise ValueError(f"new_data_parallel_size={size}: give 1 or more replicas")
        while len(self.routable) < size:
            await self.add_replica()
        while len(self.routable) > size:
            await self.remove_replica(self.routable[-1].index, drain_timeout)

    async def remove_replica(self, i: int, drain_timeout: float = 120.0) -> None:
        """Take replica ``i`` out of routing, let its requests finish (at most ``drain_timeout``
        seconds; then those that streamed nothing go to another replica, the rest end with an
        error) and stop it. ValueError for a replica that is not serving or the last one."""
        async with self._scaling:
            if not 0 <= i < len(self.replicas) or self.replicas[i] not in self.routable:
                raise ValueError(f"engine replica {i} is not serving")
            if len(self.routable) == 1:
                raise ValueError("the last serving engine replica cannot be removed")
            r = self.replicas[i]
            r.draining = True
            deadline = time.monotonic() + drain_timeout
            while r.requests and r.dead is None and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            r.removed = True
            moved, failed = self._leave(i, "removed", EngineError(
                f"engine replica {i} was removed before the request finished"))
            await r.link.stop(5)
            self.stats = merge_stats([x.stats for x in self.live])
            logger.info("engine replica %d removed (%d requests moved, %d failed); %d serving",
                        i, moved, failed, len(self.routable))

