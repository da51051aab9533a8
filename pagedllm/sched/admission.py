"""Admission's first check: a prompt that can never be served fails when it is added, instead of
waiting forever. Pure Python."""

from __future__ import annotations

from pagedllm.config import SchedulerConfig
from pagedllm.kv.manager import KVCacheManager
from pagedllm.kv.window import min_blocks_to_serve
from pagedllm.request import Request


def check_fits(config: SchedulerConfig, kv: KVCacheManager, num_prompt_tokens: int) -> None:
    """ValueError, naming the flag to change, if a prompt of ``num_prompt_tokens`` tokens is
    empty, leaves no room to generate, or needs more KV blocks than the pool can ever have."""
    max_len = config.max_model_len
    if num_prompt_tokens == 0:
        raise ValueError("the prompt is empty; give at least one token")
    if num_prompt_tokens >= max_len:
        raise ValueError(
            f"the prompt has {num_prompt_tokens} tokens but max_model_len={max_len} leaves no "
            f"room to generate; shorten the prompt or raise --max-model-len"
        )
    blocks = min_blocks_to_serve(num_prompt_tokens, kv.block_size, kv.sliding_window,
                                 config.enable_chunked_prefill)
    if blocks > kv.max_num_blocks:
        raise ValueError(
            f"the prompt needs {blocks} KV blocks of {kv.block_size} tokens but the pool "
            f"has {kv.max_num_blocks}; raise --kv-cache-memory / --num-kv-blocks"
        )


def check_adapter_fits(config: SchedulerConfig, kv: KVCacheManager, req: Request) -> None:
    """ValueError if ``req``'s LoRA adapter (its pages in the pool, kv/adapters.py) and the
    request's KV at its longest could never be in the pool together: it would wait forever."""
    lora = req.lora_request
    if lora is None or lora.lora_int_id not in kv.adapters.sizes:
        return
    pages = kv.adapters.sizes[lora.lora_int_id]
    tokens = req.num_prompt_tokens + req.max_output_tokens  # KV for all but the last of them
    blocks = min_blocks_to_serve(tokens - 1, kv.block_size, kv.sliding_window,
                                 config.enable_chunked_prefill)
    if pages + blocks > kv.max_num_blocks:
        raise ValueError(
            f"LoRA adapter {lora.lora_name!r}: its weights take {pages} KV blocks and this "
            f"request up to {blocks} more ({tokens} tokens), but the pool has "
            f"{kv.max_num_blocks}; lower max_tokens or raise --kv-cache-memory / --num-kv-blocks"
        )
