"""How many KV blocks the pool gets: pure arithmetic over the configs (no torch, no model), so
``pagedllm plan`` and capacity planning run without loading weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.config import CacheConfig, ModelConfig, SchedulerConfig

DEFAULT_KV_CAP = 4 * 1024**3  # default budget cap: enough for max_num_seqs full requests, <= 4 GiB

@dataclass
class KVPoolPlan:
    """How the KV pool was sized (logged at start-up, exposed for capacity planning)."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    max_model_len: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrent_full_requests(self) -> int:
        return self.num_blocks // -(-self.max_model_len // self.block_size)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def plan_kv_pool(model: ModelConfig, cache: CacheConfig, sched: SchedulerConfig,
                 measured_budget: int | None = None) -> KVPoolPlan:
    """Blocks from ``num_kv_blocks``, else ``kv_cache_memory``, else ``measured_budget`` (bytes a
    GPU profile left for KV, runner/memory.py), else the default cap."""
    per_block = cache.kv_bytes_per_block(model)
    blocks_per_req = -(-sched.max_model_len // cache.block_size)
    if cache.num_kv_blocks is not None:
        num_blocks = cache.num_kv_blocks
    else:
        budget = cache.kv_cache_memory if cache.kv_cache_memory is not None else measured_budget
        if budget is None:
            budget = min(DEFAULT_KV_CAP, sched.max_num_seqs * blocks_per_req * per_block)
            budget = max(budget, blocks_per_req * per_block)
        num_blocks = budget // per_block
    if num_blocks < blocks_per_req:
        need = blocks_per_req * per_block
        raise ValueError(
            f"max_model_len={sched.max_model_len} needs {blocks_per_req} blocks of "
            f"{cache.block_size} tokens ({need / 2**20:.1f} MiB) but the KV pool has {num_blocks}; "
            f"lower --max-model-len or raise --kv-cache-memory / --num-kv-blocks"
            + (" / --gpu-memory-utilization" if measured_budget is not None else "")
        )
    return KVPoolPlan(num_blocks, cache.block_size, per_block, sched.max_model_len)
