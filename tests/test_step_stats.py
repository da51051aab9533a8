"""One StepStats record per engine step: its counts equal an independent recount of the engine's
state, the request events add up to what the requests produced, and kv_stats() reads it."""

from __future__ import annotations

import random
from pathlib import Path

from pagedllm import LLM, SamplingParams
from pagedllm.engine import LLMEngine
from pagedllm.sched.stats import StepStats


def _census(eng: LLMEngine) -> dict[str, int]:
    """KV blocks by state, counted block by block (what the record keeps incrementally)."""
    blocks = eng.kv.pool.blocks
    return {
        "total": len(blocks),
        "free": sum(b.ref_cnt == 0 for b in blocks),
        "cached": sum(b.ref_cnt == 0 and b.block_hash is not None for b in blocks),
        "shared": sum(b.ref_cnt > 1 for b in blocks),
        "host_used": eng.kv.num_host_blocks - eng.kv.num_free_host_blocks,
    }


def test_every_step_is_recorded_and_its_counts_are_true(tiny_models: dict[str, Path]) -> None:
    llm = LLM(model=str(tiny_models["llama"]), block_size=4, num_kv_blocks=40, max_model_len=128,
              max_num_batched_tokens=48, reserved_fraction=0.0, swap_space=0.002,
              preemption_mode="swap")
    eng = llm.engine
    rng = random.Random(0)
    system = [rng.randrange(4, 500) for _ in range(12)]
    prompts = [system + [rng.randrange(4, 500) for _ in range(rng.randrange(3, 30))]
               for _ in range(10)]
    params = [SamplingParams(n=2 if i % 4 == 0 else 1, temperature=1.0, seed=i, max_tokens=20,
                             ignore_eos=True) for i in range(len(prompts))]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    records: list[StepStats] = []
    produced: dict[str, int] = {}
    while eng.has_unfinished_requests():
        before = eng.scheduler.num_steps
        outs = eng.step()
        s = eng.stats
        records.append(s)
        assert s.step == before + 1 and s.step_time_s > 0
        census = _census(eng)
        assert (s.kv.total, s.kv.free, s.kv.cached, s.kv.shared, s.kv.host_used) == (
            census["total"], census["free"], census["cached"], census["shared"],
            census["host_used"])
        assert (s.num_running, s.num_waiting, s.num_swapped) == (
            eng.scheduler.num_running, eng.scheduler.num_waiting, eng.scheduler.num_swapped)
        assert s.num_preemptions == sum(s.preemptions_by_kind[k] for k in ("recompute", "swap"))
        assert 0 < s.live_tokens <= s.reserved_tokens or s.batch_running == 0
        for o in outs:
            if o.finished:
                produced[o.request_id] = sum(len(c.token_ids) for c in o.outputs)
        eng.check_integrity()
    assert records[-1].num_preemptions > 0 and records[-1].preemptions_by_kind["swap"] > 0
    assert records[-1].kv.shared == 0 and records[-1].kv.free == records[-1].kv.total
    assert max(r.kv.shared for r in records) > 0  # n=2 forks and the shared system prompt
    assert max(r.kv.host_used for r in records) > 0
    # request events add up to what the requests produced
    assert sum(r.num_generation_tokens for r in records) == sum(produced.values()) == 20 * 13
    assert sum(len(r.time_to_first_token_s) for r in records) == len(prompts)
    assert sum(r.num_prompt_tokens for r in records) == sum(len(p) for p in prompts)
    assert sum(len(r.e2e_latency_s) for r in records) == len(prompts)
    assert sorted(x for r in records for x in r.finish_reasons) == ["length"] * 13
    # itl: one per request and step after its first token
    assert sum(len(r.inter_token_latency_s) for r in records) >= 19 * len(prompts)
    # prompt positions computed: every prompt once, plus what was recomputed or not hit
    prefill = sum(r.num_prefill_tokens for r in records)
    hits = records[-1].prefix_cache_hits
    assert prefill >= sum(len(p) for p in prompts) - hits
    assert hits > 0 and records[-1].prefix_cache_queries >= sum(len(p) for p in prompts)
    assert sum(r.num_decode_tokens for r in records) > 0


def test_kv_stats_reads_the_record(tiny_models: dict[str, Path]) -> None:
    llm = LLM(model=str(tiny_models["llama"]), block_size=4, num_kv_blocks=64, max_model_len=128)
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    eng.add_request("a", [5, 6, 7, 8, 9, 10, 11, 12, 13], sp)
    eng.step()
    stats, now = llm.kv_stats(), eng.current_stats()
    assert stats["used_blocks"] == now.kv.used == _census(eng)["total"] - _census(eng)["free"] > 0
    assert stats["num_blocks"] == 64 and stats["free_blocks"] == now.kv.free
    assert stats["kv_utilization"] == now.kv_utilization == now.live_tokens / now.reserved_tokens
    eng.abort_request("a")
    assert eng.stats.num_running == 0 and eng.stats.kv.free == 64  # an abort refreshes it
    assert llm.kv_stats()["cached_blocks"] == _census(eng)["cached"] == 2


def test_kv_utilization_has_one_definition_everywhere(tiny_models: dict[str, Path]) -> None:
    """Live tokens / the slots of the holders' block tables, a shared block once per holder: with
    two requests on one cached prefix it stays <= 1 (live / used pool slots would be > 1), and
    kv_stats(), the step record, the benchmarks' probe and the planner's replay all give it."""
    from pagedllm.bench.probe import StepTrace
    from pagedllm.bench.workload import BenchRequest
    from pagedllm.planner.cost import StepCostModel
    from pagedllm.planner.replay import replay

    llm = LLM(model=str(tiny_models["llama"]), block_size=4, num_kv_blocks=64, max_model_len=128)
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prefix = list(range(5, 17))  # 3 full blocks
    eng.add_request("a", prefix + [20, 21], sp)
    eng.step()
    eng.add_request("b", prefix + [30], sp)
    probe = StepTrace()
    eng.step()
    probe.add(eng.stats)
    tables = {rid: eng.kv.block_table(rid) for rid in ("a", "b")}
    assert tables["a"][:3] == tables["b"][:3]  # b hit a's prefix
    live = sum(r.num_computed_tokens for r in eng.scheduler.running)
    reserved = 4 * sum(len(t) for t in tables.values())
    pool = 4 * len({b for t in tables.values() for b in t})
    assert live / pool > 1 >= live / reserved  # what the two old definitions disagreed on
    now = eng.current_stats()
    assert llm.kv_stats()["kv_utilization"] == now.kv_utilization == live / reserved
    assert eng.stats.kv_utilization == probe.utilization[0] == probe.summary()["kv_utilization"]
    # the replay of the same arrivals (b once a's prefill ran) records the same step
    one_s_per_token = StepCostModel((1,), (1.0,))
    res = replay([BenchRequest(prefix + [20, 21], 6), BenchRequest(prefix + [30], 6)],
                 eng.config, one_s_per_token, arrivals=[0.0, 0.5])
    assert (res.series_live[1], res.series_reserved[1]) == (live, reserved)
    assert res.kv_series()["kv_utilization"][1] == live / reserved
    assert res.kv_means()["kv_utilization"] == sum(res.series_live) / sum(res.series_reserved)
