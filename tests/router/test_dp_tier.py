"""Two engine-core processes sharing a Ray KV tier (``--kv-transfer-config`` ray) behind one
``DPClient`` under round_robin: a replica that misses a system prompt loads its blocks from the
tier, so the pair computes what one engine computes; greedy outputs are one engine's."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

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


@pytest.fixture
def ray_cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Ray, with no RAY_ADDRESS: the DPClient starts a local cluster and names it there for its
    replica processes; afterwards Ray is shut down and RAY_ADDRESS is as it was."""
    ray = pytest.importorskip("ray")
    monkeypatch.setenv("RAY_ADDRESS", "")  # recorded, so teardown restores the original
    monkeypatch.delenv("RAY_ADDRESS")
    yield ray
    ray.shutdown()


@pytest.mark.slow  # a local Ray instance and two engine processes: ~40 s on 2 cores
def test_round_robin_with_the_tier_computes_what_one_engine_computes(ray_cluster: Any) -> None:
    want = reference(PROMPTS, 12)

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

    plain, _ = asyncio.run(computed(False, 1))
    with_tier, stats = asyncio.run(computed(True, 2))
    t = TENANTS
    one_engine = t["tenants"] * t["system_len"] + t["tenants"] * t["users"] * t["user_len"]
    print(f"\ncomputed prefill tokens, round_robin over 2 replicas: {plain} without the tier, "
          f"{with_tier} with it (one engine: {one_engine}); tier bytes loaded "
          f"{stats['kv_tier_bytes_loaded']}, stored {stats['kv_tier_bytes_stored']}")
    assert with_tier <= 1.1 * one_engine and with_tier <= 0.8 * plain, (plain, with_tier)
    assert stats["external_prefix_cache_hits"] > 0 and stats["kv_tier_bytes_loaded"] > 0


@pytest.mark.slow  # a local Ray instance and two engine processes: ~30 s on 2 cores
def test_prefill_decode_split_decodes_without_computing_the_prompt(ray_cluster: Any) -> None:
    """``--prefill-replicas 1`` of 2: replica 0 prefills, replica 1 loads the prompt's full
    blocks from the tier and computes only each prompt's last partial block; with the prefill
    replica killed, the decode replica serves whole requests."""
    want = reference(PROMPTS, 12)
    prompts = tenant_workload(7, tenants=2, users=3, system_len=100, user_len=21)
    want_tok = reference([{"prompt_token_ids": p} for p in prompts], 4)

    async def main() -> tuple[list, list, list[int], dict]:
        tier = {"kv_connector": "ray", "kv_connector_extra_config": {"actor_name": "pd-tier"}}
        dp = DPClient(engine_args(kv_transfer_config=tier), size=2, policy="cache_aware",
                      num_threads=1, prefill_replicas=1)
        await dp.start()
        try:
            got = await asyncio.gather(*(generate(dp, f"p{i}", p, greedy(12))
                                         for i, p in enumerate(PROMPTS)))
            before = [r.computed_prefill_tokens for r in dp.replicas]
            toks = await run_workload(dp, prompts, 2, 4, "w")
            computed = [r.computed_prefill_tokens - b for r, b in zip(dp.replicas, before)]
            stats = await dp.kv_stats()
            dp.replicas[0].link.kill()  # type: ignore[attr-defined]
            while dp.degraded is None:
                await asyncio.sleep(0.05)
            # no prefill replica left: the decode replica prefills as well
            assert await generate(dp, "alone", PROMPTS[2], greedy(12)) == want[2]
            return got, toks, computed, stats
        finally:
            await dp.shutdown()

    got, toks, computed, stats = asyncio.run(main())
    assert got == want and toks == want_tok
    last_partial = sum(len(p) - 16 * ((len(p) - 1) // 16) for p in prompts)
    print(f"\nprefill/decode: prefill replica computed {computed[0]}, decode replica "
          f"{computed[1]} (last partial blocks: {last_partial})")
    assert 0 < computed[1] <= last_partial, computed
    decode = stats["replicas"][1]
    assert decode["external_prefix_cache_hits"] > 0 and decode["kv_tier_blocks_stored"] >= 0


@pytest.mark.slow  # a local Ray instance and two engine processes: ~20 s on 2 cores
def test_prefill_decode_split_under_preemption(ray_cluster: Any) -> None:
    """A decode replica of 17 blocks running two 121-token prompts at once must preempt one
    as they grow; the preempted request loads its prompt from the tier again, and every
    output is one engine's."""
    prompts = tenant_workload(11, tenants=2, users=3, system_len=100, user_len=21)
    want = reference([{"prompt_token_ids": p} for p in prompts], 24)

    async def main() -> tuple[list, dict]:
        tier = {"kv_connector": "ray", "kv_connector_extra_config": {"actor_name": "pd-small"}}
        dp = DPClient(engine_args(kv_transfer_config=tier, num_kv_blocks=17, max_model_len=160), size=2,
                      policy="round_robin", num_threads=1, prefill_replicas=1)
        await dp.start()
        try:
            got = await run_workload(dp, prompts, 6, 24, "w")
            return got, await dp.kv_stats()
        finally:
            await dp.shutdown()

    got, stats = asyncio.run(main())
    decode = stats["replicas"][1]
    print(f"\ndecode replica: {decode['num_preemptions']} preemptions, "
          f"{decode['external_prefix_cache_hits']} prompt tokens loaded")
    assert got == want
    assert decode["num_preemptions"] > 0 and decode["external_prefix_cache_hits"] > 0
