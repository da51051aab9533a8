"""Two engine-core processes sharing a Ray KV tier (``--kv-transfer-config`` ray) behind one
``DPClient`` under round_robin: a replica that misses a system prompt loads its blocks from the
tier, so the pair computes what one engine computes; greedy outputs are one engine's."""

from __future__ import annotations

import asyncio
import os

import pytest
from dp_helpers import (
    PROMPTS,
    engine_args,
    generate,
    greedy,
    reference,
    run_workload,
    tenant_workload,
)

from pagedllm.router.client import DPClient

TENANTS = dict(tenants=4, users=6, system_len=160, user_len=24)


@pytest.mark.slow  # a local Ray instance and two engine processes: ~40 s on 2 cores
def test_round_robin_with_the_tier_computes_what_one_engine_computes() -> None:
    ray = pytest.importorskip("ray")
    want = reference(PROMPTS, 12)
    address = os.environ.pop("RAY_ADDRESS", None)  # DPClient names the cluster it starts here

    async def computed(tier: bool, token_seed: int) -> tuple[int, dict]:
        extra = {"kv_transfer_config": {"kv_connector": "ray", "kv_connector_extra_config":
                                        {"actor_name": f"dp-tier-{token_seed}"}}} if tier else {}
        dp = DPClient(engine_args(**extra), size=2, policy="round_robin", num_threads=1)
        await dp.start()
        try:
            if tier:
                got = [await generate(dp, "p0", PROMPTS[0], greedy(12))]
                got += await asyncio.gather(*(generate(dp, f"p{i}", p, greedy(12))
                                              for i, p in enumerate(PROMPTS) if i))
                assert got == want
            before = sum(r.computed_prefill_tokens for r in dp.replicas)
            await run_workload(dp, tenant_workload(token_seed, **TENANTS), 1, 4, "w")
            return (sum(r.computed_prefill_tokens for r in dp.replicas) - before,
                    await dp.kv_stats())
        finally:
            await dp.shutdown()

    try:
        plain, _ = asyncio.run(computed(False, 1))
        with_tier, stats = asyncio.run(computed(True, 2))
    finally:
        ray.shutdown()
        os.environ.pop("RAY_ADDRESS", None)
        if address is not None:
            os.environ["RAY_ADDRESS"] = address
    t = TENANTS
    one_engine = t["tenants"] * t["system_len"] + t["tenants"] * t["users"] * t["user_len"]
    print(f"\ncomputed prefill tokens, round_robin over 2 replicas: {plain} without the tier, "
          f"{with_tier} with it (one engine: {one_engine}); tier bytes loaded "
          f"{stats['kv_tier_bytes_loaded']}, stored {stats['kv_tier_bytes_stored']}")
    assert with_tier <= 1.1 * one_engine and with_tier <= 0.8 * plain, (plain, with_tier)
    assert stats["external_prefix_cache_hits"] > 0 and stats["kv_tier_bytes_loaded"] > 0
