"""The KV statistics dict (``LLM.kv_stats()``) and the elastic-pool / compaction controller.
No torch."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.kv.manager import KVCacheManager
    from pagedllm.sched import Scheduler


def kv_utilization(sched: Scheduler, kv: KVCacheManager) -> float:
    """Live tokens / slots of the used blocks (1.0 = no internal fragmentation)."""
    used = kv.num_used_blocks
    live = sum(r.num_computed_tokens for r in sched.requests.values() if kv.has_request(r.request_id))
    return live / (used * kv.block_size) if used else 0.0


def kv_stats(sched: Scheduler, kv: KVCacheManager) -> dict[str, Any]:
    pool = kv.pool
    cached = sum(1 for b in pool.blocks if b.ref_cnt == 0 and b.block_hash is not None)
    return {
        "num_blocks": pool.num_blocks,
        "used_blocks": pool.num_blocks - pool.num_free_blocks,
        "cached_blocks": cached,
        "free_blocks": pool.num_free_blocks,
        "pinned_blocks": kv.num_pinned_blocks,
        "kv_utilization": kv_utilization(sched, kv),
        "prefix_cache_queries": kv.stats.queries,
        "prefix_cache_hits": kv.stats.hits,
        "prefix_cache_hit_rate": kv.stats.hit_rate,
        "num_preemptions": sched.num_preemptions,
        "preemptions_by_kind": dict(sched.preemptions_by_kind),
        "swapped_out_blocks": kv.host.stats["out"],
        "swapped_in_blocks": kv.host.stats["in"],
        "num_swapped": sched.num_swapped,
    }


class KVMemoryController:
    """Engine-side policy around the pool: compaction triggers and elastic growth / shrink.

    Grow: before a step, if the free blocks cannot cover the next step's worst case (the token
    budget's worth of blocks plus one per running request), add ``grow_chunk`` blocks (or what
    is missing), up to the memory budget. Shrink: when the engine is idle, compact and release the
    free tail, down to ``initial_num_kv_blocks``. Compaction: on demand, every N steps, or after a
    window of steps with kv utilization below a threshold.
    """

    def __init__(self, engine: Any) -> None:
        # a proxy, not a reference: the engine owns this controller, and a cycle would keep a
        # dropped engine's KV pool (GPU memory) alive until the next full gc pass
        self.engine = weakref.proxy(engine)
        self.cache = engine.config.cache
        self.initial = engine.kv.num_blocks
        self.steps = 0
        self.low_steps = 0
        self.num_compactions = 0
        self.num_grows = 0
        self.num_shrinks = 0

    @property
    def elastic(self) -> bool:
        return self.engine.kv.max_num_blocks > self.initial

    def before_step(self) -> None:
        kv, sched = self.engine.kv, self.engine.scheduler
        if not self.elastic or kv.num_blocks >= kv.max_num_blocks:
            return
        want = sum(r.num_tokens - r.num_computed_tokens for r in sched.requests.values())
        budget = self.engine.config.scheduler.max_num_batched_tokens
        need = -(-min(want, budget) // kv.block_size) + len(sched.running)
        if need > kv.num_free_blocks:
            n = min(max(self.cache.grow_chunk, need - kv.num_free_blocks),
                    kv.max_num_blocks - kv.num_blocks)
            kv.grow(n)
            self.engine.runner.kv_cache.resize(kv.num_blocks)
            self.num_grows += 1

    def after_step(self) -> None:
        self.steps += 1
        c, kv = self.cache, self.engine.kv
        due = bool(c.compact_every_n_steps) and self.steps % c.compact_every_n_steps == 0
        if c.compact_below_utilization is not None:
            util = kv_utilization(self.engine.scheduler, kv)  # not all of kv_stats: per step
            self.low_steps = self.low_steps + 1 if util < c.compact_below_utilization else 0
            if self.low_steps >= c.compact_window_steps:
                due, self.low_steps = True, 0
        if due:
            self.defragment()
        if self.elastic and kv.num_blocks > self.initial and not self.engine.has_unfinished_requests():
            self.defragment()
            if kv.shrink(max(self.initial, kv.num_used_blocks)):
                self.engine.runner.kv_cache.resize(kv.num_blocks)
                self.num_shrinks += 1

    def defragment(self) -> int:
        moves = self.engine.kv.compact()
        self.engine.runner.kv_cache.copy_blocks(moves)
        self.num_compactions += 1
        return len(moves)
