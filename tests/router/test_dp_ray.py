"""``--data-parallel-backend ray`` on a local Ray cluster: two replicas as Ray actors give one
engine's greedy outputs, their KV events steer cache_aware, ``kv_stats`` sums them, and an actor
that dies leaves routing while the other serves on; an actor added while serving takes requests
and one removed drains first."""

from __future__ import annotations

import asyncio
import time

import pytest
from dp_helpers import PROMPTS, engine_args, generate, greedy, reference, tenant_workload

from pagedllm.router.client import DPClient
from pagedllm.router.policy import ReplicaLoad
from pagedllm.router.prefix_index import lookup_blocks, request_block_hashes


@pytest.mark.slow  # a local Ray instance and two actors: ~35 s on 2 cores
def test_ray_replicas_match_one_engine_and_survive_a_dead_actor() -> None:
    ray = pytest.importorskip("ray")
    want = reference(PROMPTS, 12)
    fresh = [{"prompt_token_ids": p} for p in tenant_workload(9, tenants=4, users=1)]
    want_fresh = reference(fresh, 12)
    ray.init(num_cpus=2, include_dashboard=False)

    async def main() -> None:
        dp = DPClient(engine_args(), size=2, backend="ray", policy="cache_aware", num_threads=1)
        await dp.start()
        try:
            assert [r.link.describe().split(" (")[0] for r in dp.replicas] == [
                "the Ray actor of engine replica 0", "the Ray actor of engine replica 1"]
            # the first alone: its system prompt is cached (and reported) before the others come
            got = [await generate(dp, "r0", PROMPTS[0], greedy(12))]
            got += await asyncio.gather(*(generate(dp, f"r{i}", p, greedy(12))
                                          for i, p in enumerate(PROMPTS) if i > 0))
            assert got == want
            assert all(r.computed_prefill_tokens > 0 for r in dp.replicas)
            stats = await dp.kv_stats()
            assert len(stats["replicas"]) == 2 and stats["prefix_cache_hits"] > 0
            assert stats["num_blocks"] == 2 * engine_args().num_kv_blocks  # type: ignore[operator]
            # finished requests leave nothing pending: a hit now comes from the actors' KV events
            ids = await dp.run_on_tokenizer_thread(lambda fe: fe.input.tokenize(PROMPTS[0])[1])
            hashes = request_block_hashes(ids, dp.config.cache.block_size)
            loads = [ReplicaLoad(0, 0), ReplicaLoad(1, 0)]
            assert dp.policy.choose(hashes, lookup_blocks(len(ids), 16), loads).why == "cache"
            dp.replicas[1].link.kill()  # type: ignore[attr-defined]
            deadline = time.monotonic() + 10
            while dp.degraded is None:
                assert time.monotonic() < deadline, "a dead actor is still routed to"
                await asyncio.sleep(0.05)
            assert dp.is_running
            again = await asyncio.gather(*(generate(dp, f"again{i}", p, greedy(12))
                                           for i, p in enumerate(PROMPTS[:3])))
            assert again == want[:3]
            added = await dp.add_replica()  # a third actor, while one serves
            assert added == 2 and [r.index for r in dp.routable] == [0, 2]
            more = await asyncio.gather(*(generate(dp, f"more{i}", p, greedy(12))
                                          for i, p in enumerate(fresh)))  # cached nowhere
            assert more == want_fresh and dp.replicas[2].computed_prefill_tokens > 0
            await dp.remove_replica(0)
            assert [r.index for r in dp.routable] == [2]
            assert await generate(dp, "last", PROMPTS[1], greedy(12)) == want[1]
        finally:
            await dp.shutdown()

    try:
        asyncio.run(main())
    finally:
        ray.shutdown()

