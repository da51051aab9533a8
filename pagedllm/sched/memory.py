"""KV memory decisions: elastic pool growth and shrink, compaction triggers.

The decisions are made here, held by the scheduler, where the queues and the KV manager are both
in view; the KV manager changes at once (pure bookkeeping) and the tensor side travels as the
step's ``KVUpdate`` (sched/output.py), which the runner and every worker apply. Pure Python.

Grow: when a step is scheduled, if the free blocks cannot cover its worst case (the token
budget's worth of blocks plus one per running request), add ``grow_chunk`` blocks (or what is
missing), up to the memory budget (``KVCacheManager.max_num_blocks``). Compaction: on demand
(``defragment``), every N steps, or after a window of steps with kv utilization below a
threshold. Shrink: when the engine is idle, compact and release the free tail, down to the
initial size. The last two are decided at the end of a step and run as a KV-only step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from pagedllm.config import CacheConfig
from pagedllm.kv.manager import KVCacheManager
from pagedllm.request import Request
from pagedllm.sched.output import SchedulerOutput


def kv_utilization(live_tokens: int, reserved_tokens: int) -> float:
    """KV utilization, the one definition (``kv_stats()``, ``StepStats.kv_utilization``, the
    benchmarks, the planner and the low-utilization compaction trigger all use it): the share of
    the slots in the block tables of the requests holding KV that hold a computed token
    (``kv_slots``). 1 = no slot left empty; 1 - it is internal fragmentation. A shared block
    counts once per table holding it, so it never exceeds 1; how much of the pool is handed out
    is the pool usage (used blocks / blocks), a different number. 0 when nothing is reserved."""
    return live_tokens / reserved_tokens if reserved_tokens else 0.0


def kv_slots(requests: Iterable[Request], kv: KVCacheManager,
             new_tokens: Mapping[str, int] | None = None) -> tuple[int, int]:
    """(live, reserved) tokens of the ``requests`` holding device KV: live = computed tokens,
    plus ``new_tokens`` the step about to run writes, less the positions freed behind a sliding
    window; reserved = the blocks held x block size."""
    live = reserved = 0
    for r in requests:
        rid = r.request_id
        if kv.has_request(rid):
            live += r.num_computed_tokens + (new_tokens.get(rid, 0) if new_tokens else 0)
            live -= kv.num_skipped_blocks(rid) * kv.block_size
            reserved += kv.num_blocks_of(rid)
    return live, reserved * kv.block_size


class KVMemoryPolicy:
    """Grow / compact / shrink decisions for one KV manager (see the module docstring)."""

    def __init__(self, kv: KVCacheManager, cache: CacheConfig | None = None,
                 max_num_batched_tokens: int = 2048) -> None:
        self.kv = kv
        self.cache = cache if cache is not None else CacheConfig()
        self.max_num_batched_tokens = max_num_batched_tokens
        self.initial = kv.num_blocks
        self.steps = 0
        self.low_steps = 0
        self.num_compactions = 0
        self.num_grows = 0
        self.num_shrinks = 0

    @property
    def elastic(self) -> bool:
        return self.kv.max_num_blocks > self.initial

    def grow(self, out: SchedulerOutput, requests: Iterable[Request], num_running: int) -> None:
        """Before a step is scheduled: grow the pool if the step might run short of blocks."""
        kv = self.kv
        if not self.elastic or kv.num_blocks >= kv.max_num_blocks:
            return
        want = sum(r.num_tokens - r.num_computed_tokens for r in requests)
        need = -(-min(want, self.max_num_batched_tokens) // kv.block_size) + num_running
        if need > kv.num_free_blocks:
            n = min(max(self.cache.grow_chunk, need - kv.num_free_blocks),
                    kv.max_num_blocks - kv.num_blocks)
            kv.grow(n)
            out.kv.resize = kv.num_blocks
            self.num_grows += 1

    def end_step(self, requests: Iterable[Request], idle: bool) -> SchedulerOutput | None:
        """After a step: compaction if a trigger fired, shrink if ``idle``; the KV-only step that
        applies them, or None. Then the step's KV events go out as one batch (kv/events.py)."""
        try:
            return self._upkeep(requests, idle)
        finally:
            self.kv.events.end_step()

    def _upkeep(self, requests: Iterable[Request], idle: bool) -> SchedulerOutput | None:
        self.steps += 1
        c, kv = self.cache, self.kv
        every = c.compact_every_n_steps
        due = every is not None and every > 0 and self.steps % every == 0
        if c.compact_below_utilization is not None:
            util = kv_utilization(*kv_slots(requests, kv))
            self.low_steps = self.low_steps + 1 if util < c.compact_below_utilization else 0
            if self.low_steps >= c.compact_window_steps:
                due, self.low_steps = True, 0
        shrink = idle and self.elastic and kv.num_blocks > self.initial
        if not (due or shrink):
            return None
        out = SchedulerOutput()
        if due:
            self.compact(out)
        if shrink:
            self.compact(out)
            if kv.shrink(max(self.initial, kv.num_used_blocks)):
                out.kv.resize = kv.num_blocks
                self.num_shrinks += 1
        return None if out.kv.is_empty else out

    def defragment(self) -> SchedulerOutput:
        """Compact now (between steps): the KV-only step that moves the blocks."""
        out = SchedulerOutput()
        self.compact(out)
        return out

    def compact(self, out: SchedulerOutput) -> None:
        out.kv.compaction.extend(self.kv.compact())
        self.num_compactions += 1
