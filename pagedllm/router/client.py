"""``DPClient``: N engine-core replicas behind one front end (``pagedllm serve
--data-parallel-size N``), each request routed to one of them.

::

    front end (one tokenizer, one output processor)       replica i (its own engine core)
    ───────────────────────────────────────────────       ───────────────────────────────
    add_request ─▶ tokenize ─▶ policy.choose ─▶ EngineCoreRequest ─▶ link i (process | Ray actor)
    abort ─────────────────────────────────────▶ Abort ─▶ the replica that owns the request
    OutputStream ◀─ RequestOutput ◀─ EngineCoreOutputs ◀─ step (+ its KV events ─▶ policy)

Replicas are ``CoreLink``s (``ProcessLink`` for ``mp``, ``RayLink`` for ``ray``); the policy
(``router.policy``) sees each one's load and, for ``cache_aware``, its KV events' block hashes.
A replica that dies leaves routing: its requests that streamed nothing yet go to a live replica
(from scratch), the others end with an ``EngineError``; ``degraded`` names the ones down. While
serving, ``add_replica`` starts one more and ``remove_replica`` drains one and stops it.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from functools import partial
from typing import Any

from pagedllm._cpu import serving_threads, usable_cores
from pagedllm.args import EngineArgs
from pagedllm.config import EngineConfig
from pagedllm.engine.client import (
    EngineClient,
    EngineError,
    EngineUnavailable,
    FrontEnd,
    OutputStream,
    ServerShuttingDown,
)
from pagedllm.engine.client_mp import FrontEndIdle, watch_link
from pagedllm.engine.core_link import WATCH_S, CoreLink
from pagedllm.engine.core_proc import BURST_GAP_MS, CoreOptions
from pagedllm.engine.messages import (
    Abort,
    CoreDead,
    EngineCoreOutputs,
    EngineCoreRequest,
    FromCore,
    ToCore,
    UtilityCall,
    UtilityResult,
)
from pagedllm.kv.ray_tier import share_ray_cluster
from pagedllm.logging_utils import init_logger
from pagedllm.lora.request import LoRARequest, lora_extra_keys
from pagedllm.router.aggregate import engine_row, merge_kv_stats, merge_stats
from pagedllm.router.disagg import PrefillDecode
from pagedllm.router.policy import IMBALANCE_THRESHOLD, ReplicaLoad, make_policy
from pagedllm.router.prefix_index import lookup_blocks, request_block_hashes
from pagedllm.router.replica import Replica, Route, make_link
from pagedllm.router.scaling import ElasticReplicas
from pagedllm.sched.stats import StepStats

logger = init_logger(__name__)

BACKENDS = ("mp", "ray")


class DPClient(ElasticReplicas, EngineClient):
    """``size`` engine cores, one front end. ``num_threads``: torch threads per replica
    (default: this machine's cores / size; with Ray also the CPUs each actor reserves)."""

    def __init__(self, engine_args: EngineArgs, config: EngineConfig | None = None, *,
                 size: int = 2, backend: str = "mp", policy: str = "cache_aware",
                 batch_wait_ms: float = 0.0, num_threads: int | None = None,
                 imbalance_threshold: int = IMBALANCE_THRESHOLD, prefill_replicas: int = 0,
                 burst_gap_ms: float = BURST_GAP_MS) -> None:
        if size < 1:
            raise ValueError(f"--data-parallel-size {size}: give 1 or more replicas")
        if backend not in BACKENDS:
            raise ValueError(f"--data-parallel-backend {backend!r}: choose mp or ray")
        if batch_wait_ms < 0:
            raise ValueError(f"batch_wait_ms={batch_wait_ms} must be >= 0")
        config = config or engine_args.create_engine_config()
        if prefill_replicas and config.cache.kv_transfer is None:
            raise ValueError("--prefill-replicas hands the prompt's KV over the KV tier: give "
                             "--kv-transfer-config too")
        self.pd = PrefillDecode(prefill_replicas, size) if prefill_replicas else None
        super().__init__(FrontEnd(config), StepStats())
        self.policy = make_policy(policy, imbalance_threshold)
        threads = num_threads or serving_threads(size) or max(1, usable_cores() // size)
        self._engine_args, self._backend = engine_args, backend
        self._options = CoreOptions(batch_wait_ms, threads, kv_events=self.policy.uses_hashes,
                                    burst_gap_ms=burst_gap_ms)
        self.replicas = [Replica(i, self._link(i)) for i in range(size)]
        self._scaling = asyncio.Lock()
        self.num_retried = 0  # requests sent again after their replica died
        self._routes: dict[str, Route] = {}
        self._call_targets: dict[int, int] = {}  # utility call id -> replica
        # adapter name -> (its add_lora call's args, its blocks' prefix-cache key), from the
        # add_lora calls every replica took (a replica added later takes them too)
        self._loras: dict[str, tuple[tuple[Any, ...], tuple | None]] = {}
        self._started = False
        self._stopping = False
        self._tasks: list[asyncio.Task[None]] = []
        self.idle = FrontEndIdle(self)

    # -- life -----------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start every replica (in parallel) and wait until all are built; RuntimeError naming
        the first that failed (the others are stopped)."""
        if self._started:
            return
        self._started = True
        self._loop = asyncio.get_running_loop()
        if self._backend == "mp" and self.config.cache.kv_transfer is not None:
            share_ray_cluster(self.config.cache.kv_transfer)  # one tier for every process
        got = await asyncio.gather(*(r.link.start(partial(self._from_replica, r.index))
                                     for r in self.replicas), return_exceptions=True)
        failed = [g for g in got if isinstance(g, BaseException)]
        if failed:
            self._stopping = True
            await asyncio.gather(*(r.link.stop(5) for r, g in zip(self.replicas, got)
                                   if not isinstance(g, BaseException)), return_exceptions=True)
            raise RuntimeError(f"{len(failed)} of {len(self.replicas)} engine replicas failed "
                               f"to start: {failed[0]}") from failed[0]
        for r, ready in zip(self.replicas, got):
            r.stats = ready.stats  # type: ignore[union-attr]
        self.stats = merge_stats([r.stats for r in self.replicas])
        self._tasks = [asyncio.ensure_future(self._watch(r)) for r in self.replicas]
        self._tasks.append(asyncio.ensure_future(self._idle()))
        logger.info("%d engine replicas serving; routing policy %s", len(self.replicas),
                    self.policy.name)

    async def _watch(self, r: Replica) -> None:
        cause = await watch_link(r.link.exit_cause)
        if not self._stopping:
            self._replica_died(r.index, cause)

    async def _idle(self) -> None:
        while True:
            await asyncio.sleep(WATCH_S)
            await self.idle.tick()

    @property
    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.dead is None]

    @property
    def routable(self) -> list[Replica]:
        """The live replicas new requests may go to (not draining)."""
        return [r for r in self.replicas if r.dead is None and not r.draining]

    @property
    def is_running(self) -> bool:
        return (self._started and not self._stopping and self.dead is None
                and any(r.link.exit_cause() is None for r in self.live))

    @property
    def degraded(self) -> str | None:
        kept = [r for r in self.replicas if not r.removed]
        down = [r.index for r in kept if r.dead is not None]
        if not down:
            return None
        return (f"engine replica{'s' if len(down) > 1 else ''} {', '.join(map(str, down))} of "
                f"{len(kept)} down; {len(kept) - len(down)} serving")

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every replica (in-flight requests end with ``ServerShuttingDown``)."""
        if not self._started or self._stopping:
            return
        self._stopping = True
        await asyncio.gather(*(r.link.stop(timeout) for r in self.replicas),
                             return_exceptions=True)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._fail_local(ServerShuttingDown("the server is shutting down"))
        self._tokenizer_thread.shutdown(wait=False)

    # -- routing --------------------------------------------------------------------------------
    def _send(self, msg: ToCore) -> None:
        if isinstance(msg, EngineCoreRequest):
            self._route(msg)
        elif isinstance(msg, Abort):
            by_replica: dict[int, list[str]] = {}
            for sid in msg.request_ids:
                route = self._routes.get(self.output.group_of(sid) or sid)
                if route is not None:
                    by_replica.setdefault(route.replica, []).append(sid)
            for i, ids in by_replica.items():
                self._send_to(i, Abort(ids))
        else:
            raise TypeError(f"{type(msg).__name__} goes to one replica: use replica_utility")

    def _route(self, req: EngineCoreRequest, decode: bool = False) -> None:
        """Send ``req`` to a replica (with ``--prefill-replicas``: its prefill pass first)."""
        live, sent = self.routable, req
        if self.pd is not None:
            sent, live = self.pd.place(req, live, [r.index for r in live], decode)
        if not live:
            raise EngineUnavailable("no engine replica is running")
        bs = self.config.cache.block_size
        ids = req.prompt_token_ids
        key = self._loras[req.lora_id][1] if req.lora_id in self._loras else None
        hashes = request_block_hashes(ids, bs, key) if self.policy.uses_hashes else []
        loads = [ReplicaLoad(r.index, len(r.requests), r.kv_usage) for r in live]
        choice = self.policy.choose(hashes, lookup_blocks(len(ids), bs), loads)
        self._routes[req.request_id] = Route(choice.replica, hashes, req)
        self.replicas[choice.replica].requests.add(req.request_id)
        self.policy.routed(choice.replica, hashes)
        self.replicas[choice.replica].link.send(sent)

    def _decode(self, req: EngineCoreRequest) -> None:
        """Its prefill pass ended: the request itself to a decode replica (unless aborted)."""
        route = self._routes.pop(req.request_id, None)
        if route is None:
            return
        self.replicas[route.replica].requests.discard(req.request_id)
        self.policy.finished(route.replica, route.hashes)
        try:
            self._route(req, decode=True)
        except EngineError as e:
            self._fail_request(req.request_id, e)

    def _send_to(self, i: int, msg: ToCore) -> None:
        if self.replicas[i].dead is None:
            try:
                self.replicas[i].link.send(msg)
            except EngineUnavailable:
                pass  # its watch will see it go

    def _forget(self, request_id: str) -> OutputStream | None:
        stream = super()._forget(request_id)
        route = self._routes.pop(request_id, None)
        if route is not None:
            self.replicas[route.replica].requests.discard(request_id)
            self.policy.finished(route.replica, route.hashes)
        if self.pd is not None:
            self.pd.forget(request_id)
        return stream

    def _streamed(self, request_id: str) -> None:
        route = self._routes.get(request_id)
        if route is not None and route.request is not None:
            self._routes[request_id] = route._replace(request=None)

    # -- messages from replica i ------------------------------------------------------------------
    def _from_replica(self, i: int, msg: FromCore) -> None:
        if self.replicas[i].dead is not None:
            return  # out of routing: what it still says is not heard
        if isinstance(msg, CoreDead):
            self._replica_died(i, msg.reason)
            return
        if isinstance(msg, EngineCoreOutputs) and msg.kv_events:
            for batch in msg.kv_events:
                self.policy.on_kv_events(i, batch)
        elif isinstance(msg, UtilityResult):
            self._call_targets.pop(msg.call_id, None)
        if self.pd is not None and isinstance(msg, EngineCoreOutputs):
            for req in self.pd.prefilled(msg):
                self._decode(req)
        self._dispatch(msg, i)

    def _record_stats(self, stats: StepStats, step: bool, source: int) -> None:
        r = self.replicas[source]
        r.stats = stats
        if step:
            r.computed_prefill_tokens += stats.num_prefill_tokens
            for listener in self.stats_listeners:
                listener(stats, source)
        self.stats = merge_stats([x.stats for x in self.live])

    def engine_stats(self) -> list[tuple[int, StepStats]]:
        return [(r.index, r.stats) for r in self.live]

    # -- faults -----------------------------------------------------------------------------------
    def _replica_died(self, i: int, cause: str) -> None:
        """Replica ``i`` leaves routing: its requests that streamed nothing yet go to a live
        replica, the others end with an error; its pending calls fail."""
        if self.replicas[i].dead is not None:
            return
        moved, failed = self._leave(i, cause, EngineError(f"engine replica {i} died: {cause}"))
        logger.error("engine replica %d died (%s): %d of its requests sent to another replica, "
                     "%d that had streamed failed; %d replicas left", i, cause, moved, failed,
                     len(self.live))
        if not self.live:
            self._on_dead(f"every engine replica died (the last: {cause})")

    def _leave(self, i: int, cause: str, error: EngineError) -> tuple[int, int]:
        """Replica ``i`` out of routing for good; (requests moved, requests failed)."""
        r = self.replicas[i]
        r.dead = cause
        self.policy.remove(i)
        for call_id in [c for c, t in self._call_targets.items() if t == i]:
            del self._call_targets[call_id]
            fut = self._calls.get(call_id)
            if fut is not None and not fut.done():
                fut.set_exception(error)
        moved = failed = 0
        for rid in sorted(r.requests):
            route = self._routes.get(rid)
            if route is not None and route.request is not None and self.routable:
                self._retry(rid, route.request)
                moved += 1
            else:
                self._fail_request(rid, error)
                failed += 1
        r.requests.clear()
        return moved, failed

    def _retry(self, rid: str, req: EngineCoreRequest) -> None:
        """Send a request whose replica died, from scratch, to a live one."""
        route = self._routes.pop(rid)
        self.policy.finished(route.replica, route.hashes)
        params = req.sampling_params
        self.output.remove(rid)  # whatever it processed of the dead replica's outputs
        self.output.add(rid, None, req.prompt_token_ids, params, req.arrival_time, req.lora_id)
        self.num_retried += 1
        try:
            self._route(req)
        except EngineError as e:
            self._fail_request(rid, e)

    # -- named calls -------------------------------------------------------------------------------
    async def replica_utility(self, i: int, name: str, *args: Any) -> Any:
        """A named call (``core_proc.UTILITIES``) on replica ``i``."""
        if self.replicas[i].dead is not None:
            raise EngineUnavailable(f"engine replica {i} is down")

        def send(msg: ToCore) -> None:
            assert isinstance(msg, UtilityCall)
            self._call_targets[msg.call_id] = i
            self.replicas[i].link.send(msg)

        return await self._call(name, list(args), send)

    async def utility(self, name: str, *args: Any) -> list[Any]:
        """A named call on every replica: their results by index (None for one that is down)."""
        live = self.live
        got = await asyncio.gather(*(self.replica_utility(r.index, name, *args) for r in live))
        out: list[Any] = [None] * len(self.replicas)
        for r, g in zip(live, got):
            out[r.index] = g
        if name == "add_lora":  # (name, int id, path): its requests' blocks are keyed by the id
            self._loras[args[0]] = (args, lora_extra_keys(LoRARequest(*args)))
        elif name == "remove_lora":
            self._loras.pop(args[0], None)
        return out

    async def kv_stats(self) -> dict[str, Any]:
        """Every live replica's ``kv_stats`` summed, each under ``replicas``."""
        return merge_kv_stats(await self.utility("kv_stats"))

    async def kv_snapshot(self, show_text: bool = False, engine: int | None = None) -> dict[str, Any]:
        """Replica ``engine``'s KV map (default: the first live one), with every replica's
        queues and KV block counts under ``engines``."""
        live = self.live
        if not live:
            raise EngineUnavailable("no engine replica is running")
        i = live[0].index if engine is None else engine
        snap: dict[str, Any] = await self.replica_utility(i, "kv_snapshot", show_text)
        snap["engine"] = i
        snap["engines"] = [engine_row(r.index, r.dead is None, r.stats, len(r.requests))
                           for r in self.replicas if not r.removed]
        return snap

    # -- scaling --------------------------------------------------------------------------------
    def _link(self, i: int) -> CoreLink:
        return make_link(self._engine_args, self._backend, replace(self._options, data_parallel_rank=i))
