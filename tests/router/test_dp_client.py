"""Two engine-core processes behind one ``DPClient`` on the shipped model: greedy outputs equal
one engine's token for token under round_robin and cache_aware; on a multi-tenant shared-prefix
workload cache_aware computes about what one engine computes and far less than round_robin;
killing one replica under load loses no request that had not started streaming."""

from __future__ import annotations

import asyncio
from typing import Any

from dp_helpers import (
    PROMPTS,
    engine_args,
    generate,
    greedy,
    reference,
    run_workload,
    tenant_workload,
)

from pagedllm.engine import LLMEngine
from pagedllm.engine.client import EngineError
from pagedllm.engine.client_inproc import InProcessClient
from pagedllm.router.client import DPClient
from pagedllm.router.policy import CacheAware, RoundRobin

MAX_TOKENS = 16
TENANTS = dict(tenants=4, users=6, system_len=160, user_len=24)


def _workload(token_seed: int) -> list[list[int]]:
    return tenant_workload(token_seed, **TENANTS)


async def _computed(client: DPClient, token_seed: int, concurrency: int) -> int:
    before = sum(r.computed_prefill_tokens for r in client.replicas)
    await run_workload(client, _workload(token_seed), concurrency, 4, f"w{token_seed}")
    return sum(r.computed_prefill_tokens for r in client.replicas) - before


async def _one_engine_computed() -> tuple[int, int]:
    """One engine's computed prefill tokens on the workload: one request at a time, then 4."""
    client = InProcessClient(LLMEngine.from_engine_args(engine_args()))
    total = [0]
    client.stats_listeners.append(lambda s, _: total.__setitem__(0, total[0] + s.num_prefill_tokens))
    await client.start()
    try:
        await run_workload(client, _workload(3), 1, 4, "one")
        alone = total[0]
        await run_workload(client, _workload(4), 4, 4, "four")
        return alone, total[0] - alone
    finally:
        await client.shutdown()


def test_two_replicas_match_one_engine_and_cache_aware_computes_less() -> None:
    """Greedy outputs as one engine's under both policies; then the tenants workload (4 system
    prompts of 160 tokens x 6 users of 24): one request at a time cache_aware computes exactly
    what one engine computes (each system prompt once) and round_robin each about twice; with
    4 in flight two requests of a new prefix may meet in one step and both compute it, on one
    engine or one replica alike, so there the figures only must keep their order."""
    want = reference(PROMPTS, MAX_TOKENS)

    async def main() -> dict[str, Any]:
        dp = DPClient(engine_args(), size=2, policy="cache_aware", num_threads=1)
        await dp.start()
        try:
            got: dict[str, Any] = {}
            for name in ("cache_aware", "round_robin"):
                if name == "round_robin":
                    dp.policy = RoundRobin()  # the replicas keep sending KV events: unread
                got[f"out {name}"] = await asyncio.gather(*(
                    generate(dp, f"{name}-{i}", p, greedy(MAX_TOKENS)) for i, p in enumerate(PROMPTS)))
                got[f"{name} per replica"] = [r.computed_prefill_tokens for r in dp.replicas]
            got["computed round_robin"] = (await _computed(dp, 1, 1), await _computed(dp, 5, 4))
            dp.policy = CacheAware()  # starts empty: what it learns comes from these runs' events
            got["computed cache_aware"] = (await _computed(dp, 2, 1), await _computed(dp, 6, 4))
            return got
        finally:
            await dp.shutdown()

    got = asyncio.run(main())
    assert got["out cache_aware"] == want
    assert got["out round_robin"] == want
    assert all(n > 0 for n in got["cache_aware per replica"]), got  # both replicas served
    one = asyncio.run(_one_engine_computed())
    rr, ca = got["computed round_robin"], got["computed cache_aware"]
    print(f"\ncomputed prefill tokens (1 / 4 in flight): one engine {one}, round_robin {rr}, "
          f"cache_aware {ca}")
    t = TENANTS
    least = t["tenants"] * t["system_len"] + t["tenants"] * t["users"] * t["user_len"]
    assert one[0] == ca[0] == least, (one, rr, ca)
    assert ca[0] <= 0.8 * rr[0], (one, rr, ca)
    assert least <= ca[1] <= rr[1] and least <= one[1], (one, rr, ca)


def test_a_replica_killed_under_load_loses_no_request_that_had_not_streamed() -> None:
    prompts = [{"prompt_token_ids": [10 + i, 20 + i, 30 + i, 40, 50, 60, 70]} for i in range(12)]
    want = reference(prompts, 40)

    async def main() -> tuple[list[Any], dict[str, int], DPClient]:
        dp = DPClient(engine_args(max_num_seqs=2), size=2, policy="round_robin", num_threads=1)
        await dp.start()
        seen: dict[str, int] = {}
        try:
            tasks = [asyncio.ensure_future(generate(dp, f"r{i}", p, greedy(40), seen))
                     for i, p in enumerate(prompts)]
            victim = dp.replicas[1]
            while not any(seen.get(rid) for rid in victim.requests):  # it is streaming
                await asyncio.sleep(0.005)
            waiting = [rid for rid in victim.requests if not seen.get(rid)]
            assert waiting, "every request of replica 1 had started: nothing to retry"
            victim.link.kill()  # type: ignore[attr-defined]
            results = await asyncio.gather(*tasks, return_exceptions=True)
            assert dp.is_running and dp.degraded is not None and "1 of 2" in dp.degraded
            assert victim.dead is not None and "SIGKILL" in victim.dead
            after = await generate(dp, "after", prompts[0], greedy(40))  # replica 0 serves on
            assert after == want[0]
            return results, seen, dp
        finally:
            await dp.shutdown()

    results, seen, dp = asyncio.run(main())
    failed = [i for i, r in enumerate(results) if isinstance(r, BaseException)]
    for i, r in enumerate(results):
        if isinstance(r, BaseException):
            assert isinstance(r, EngineError) and "replica 1 died" in str(r), r
            assert seen.get(f"r{i}"), f"r{i} failed before it streamed anything: {r!r}"
        else:
            assert r == want[i], f"r{i}"
    assert dp.num_retried >= 1
    assert len(failed) < len(prompts) // 2, failed  # replica 0's half finished, retried ones too
