"""Two replicas with LoRA behind ``cache_aware``: the router hashes an adapter's prompt with the
adapter's prefix-cache key, as the replicas' KV manager does, so its view of their caches is
exact for adapters too. A repeated adapter request goes where its blocks are and computes one
token; the same prompt on the base model matches nothing there (no block crosses adapters)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from pagedllm.args import EngineArgs
from pagedllm.engine.client import OutputStream
from pagedllm.lora.request import LoRARequest, lora_extra_keys
from pagedllm.router.client import DPClient
from pagedllm.router.prefix_index import request_block_hashes
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

BS = 16
PROMPT = [(7 * i + 3) % 200 + 5 for i in range(65)]  # 4 full blocks + 1 token


async def _run(dp: DPClient, rid: str, lora: str | None) -> list[int]:
    stream = OutputStream()
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                        output_kind=RequestOutputKind.DELTA)
    await dp.add_request(rid, {"prompt_token_ids": PROMPT}, sp, stream, lora_name=lora)
    ids: list[int] = []
    async for out in stream:
        ids += out.outputs[0].token_ids
    return ids


def _computed(dp: DPClient) -> int:
    return sum(r.computed_prefill_tokens for r in dp.replicas)


def test_cache_aware_routes_adapter_requests_by_their_keyed_blocks(lora_base: Path,
                                                                   adapters: dict[str, Path]) -> None:
    args = EngineArgs.from_kwargs(dict(model=str(lora_base), enable_lora=True, max_lora_rank=16,
                                       num_kv_blocks=64, block_size=BS, max_model_len=256,
                                       dtype="float32"), "test")
    keyed = request_block_hashes(PROMPT, BS, lora_extra_keys(
        LoRARequest("attn_r4", 1, str(adapters["attn_r4"]))))
    plain = request_block_hashes(PROMPT, BS)

    async def main() -> dict[str, object]:
        dp = DPClient(args, size=2, policy="cache_aware", num_threads=1)
        await dp.start()
        try:
            await dp.utility("add_lora", "attn_r4", 1, str(adapters["attn_r4"]))
            first = await _run(dp, "a0", "attn_r4")
            holders = [i for i, idx in dp.policy.index.items() if idx.match(keyed) == 4]
            base_match = max(idx.match(plain) for idx in dp.policy.index.values())
            before = _computed(dp)
            again = await _run(dp, "a1", "attn_r4")
            repeat_cost = _computed(dp) - before
            before = _computed(dp)
            await _run(dp, "b0", None)
            base_cost = _computed(dp) - before
            return dict(first=first, again=again, holders=holders, base_match=base_match,
                        repeat_cost=repeat_cost, base_cost=base_cost)
        finally:
            await dp.shutdown()

    got = asyncio.run(main())
    assert got["again"] == got["first"]
    assert len(got["holders"]) == 1, got  # the router sees the adapter's blocks, on one replica
    assert got["base_match"] == 0, got  # the base model's hashes of the prompt: cached nowhere
    assert got["repeat_cost"] == 1, got  # routed to its blocks: only the last prompt token
    assert got["base_cost"] == len(PROMPT), got  # the base model shares no block with the adapter
