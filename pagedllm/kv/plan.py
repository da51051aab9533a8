"""How many KV blocks the pool gets: pure arithmetic over the configs (no torch, no model), so
``pagedllm plan`` and capacity planning run without loading weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedllm.kv.window import max_blocks_held

if TYPE_CHECKING:
    from pagedllm.config import CacheConfig, ModelConfig, SchedulerConfig
    from pagedllm.lora.request import LoRAConfig

DEFAULT_KV_CAP = 4 * 1024**3  # default budget cap: enough for max_num_seqs full requests, <= 4 GiB

@dataclass
class KVPoolPlan:
    """How the KV pool was sized (logged at start-up, exposed for capacity planning).

    ``sliding_window`` (a windowed model whose blocks are freed behind the window): a request of
    any length holds at most ``max_blocks_held(window, block_size)`` blocks while it decodes,
    more only while a prefill chunk runs (its window plus the chunk)."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    max_model_len: int
    sliding_window: int | None = None
    lora_blocks_per_adapter: int = 0  # an adapter of max_lora_rank on every projection
    lora_blocks: int = 0  # the default pool's room for max_loras such adapters (LoRA on)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def blocks_per_full_request(self) -> int:
        """Blocks a decoding request of ``max_model_len`` tokens holds."""
        return blocks_per_request(self.max_model_len, self.block_size, self.sliding_window)

    @property
    def max_concurrent_full_requests(self) -> int:
        """Beside ``lora_blocks`` of adapters' pages (LoRA on)."""
        return max(0, self.num_blocks - self.lora_blocks) // self.blocks_per_full_request

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def fit_summary(self) -> str:
        """'fits N requests of max_model_len=L', and what the sliding window changes."""
        out = f"fits {self.max_concurrent_full_requests} requests of max_model_len={self.max_model_len}"
        if self.sliding_window is not None:
            full = self.num_blocks // -(-self.max_model_len // self.block_size)
            out += (f" (sliding window {self.sliding_window}: each holds at most "
                    f"{self.blocks_per_full_request} blocks while decoding, its window plus a "
                    f"prefill chunk while prefilling; {full} if every block were kept)")
        if self.lora_blocks:
            out += (f", beside {self.lora_blocks} blocks of LoRA adapters' pages "
                    f"({self.lora_blocks_per_adapter} per adapter of max_lora_rank)")
        return out


def blocks_per_request(num_tokens: int, block_size: int, sliding_window: int | None) -> int:
    """Blocks a decoding request of ``num_tokens`` tokens holds: all of them, or at most its
    window's with a sliding window (kv/window.py)."""
    full = -(-num_tokens // block_size)
    if sliding_window is None:
        return full
    return min(full, max_blocks_held(sliding_window, block_size))


def lora_blocks_per_adapter(model: ModelConfig, cache: CacheConfig, rank: int) -> int:
    """KV blocks a LoRA adapter of ``rank`` on all seven projections takes in the pool, at the
    model's dtype (lora/pages.py: per layer A [r, in] and B [out, r] of every target, laid
    end to end over the block's bytes in that layer; the runner measures each real adapter)."""
    # per projection A [r, in] and B [out, r]
    layer_bytes = rank * sum(n_in + n_out for n_in, n_out in model.projection_shapes.values())
    layer_bytes *= model.dtype_bytes
    page = cache.kv_bytes_per_block(model) // model.num_hidden_layers
    return -(-layer_bytes // page)


def plan_kv_pool(model: ModelConfig, cache: CacheConfig, sched: SchedulerConfig,
                 measured_budget: int | None = None, lora: LoRAConfig | None = None) -> KVPoolPlan:
    """Blocks from ``num_kv_blocks``, else ``kv_cache_memory``, else ``measured_budget`` (bytes a
    GPU profile left for KV, runner/memory.py), else the default cap. With a sliding window the
    default fits ``max_num_seqs`` windows plus one step's prefill chunk. With ``lora`` the
    default adds room for ``max_loras`` adapters of ``max_lora_rank`` (their pages share the
    pool, kv/adapters.py); a pool sized by the user holds adapters and KV as they come."""
    per_block = cache.kv_bytes_per_block(model)
    window = cache.kv_window(model)
    blocks_per_req = blocks_per_request(sched.max_model_len, cache.block_size, window)
    per_adapter = 0 if lora is None else lora_blocks_per_adapter(model, cache, lora.max_lora_rank)
    lora_blocks = 0 if lora is None else lora.max_loras * per_adapter
    if cache.num_kv_blocks is not None:
        num_blocks = cache.num_kv_blocks
    else:
        budget = cache.kv_cache_memory if cache.kv_cache_memory is not None else measured_budget
        if budget is None:
            want = sched.max_num_seqs * blocks_per_req + lora_blocks
            if window is not None:
                chunk = min(sched.max_num_batched_tokens, sched.max_model_len)
                want += -(-chunk // cache.block_size)
            budget = min(DEFAULT_KV_CAP, want * per_block)
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
    return KVPoolPlan(num_blocks, cache.block_size, per_block, sched.max_model_len, window,
                      per_adapter, min(lora_blocks, num_blocks))
