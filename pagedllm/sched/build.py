"""The KV manager and scheduler of an engine, built from its configs in one place.

``LLMEngine`` and the planner's replay (``pagedllm.planner``) both call ``build_scheduler``, so a
replay schedules with exactly the pool, host tier, limits and preemption costs the engine would
use. Pure Python.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.kv.manager import KVCacheManager
from pagedllm.sched.memory import KVMemoryPolicy
from pagedllm.sched.preemption import PreemptionCost
from pagedllm.sched.scheduler import Scheduler

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.kv.plan import KVPoolPlan


def build_scheduler(config: EngineConfig, plan: KVPoolPlan,
                    scheduler_cls: type[Scheduler] = Scheduler) -> Scheduler:
    """A ``scheduler_cls`` over a fresh ``KVCacheManager`` (``scheduler.kv``) of ``plan``'s pool,
    with the cache config's memory policy (``scheduler.memory``: growth, compaction, shrink) and
    preemption costs. An elastic pool (``initial_num_kv_blocks``) starts small and may grow up
    to the plan."""
    cache = config.cache
    start = min(cache.initial_num_kv_blocks or plan.num_blocks, plan.num_blocks)
    kv = KVCacheManager(start, plan.block_size, cache.enable_prefix_caching,
                        num_host_blocks=cache.num_host_blocks(config.model),
                        sliding_window=plan.sliding_window)
    kv.set_max_num_blocks(plan.num_blocks)
    sched = scheduler_cls(config.scheduler, kv)
    sched.cost_model = PreemptionCost.for_engine(config, plan.bytes_per_block)
    sched.memory = KVMemoryPolicy(kv, cache, config.scheduler.max_num_batched_tokens)
    return sched
