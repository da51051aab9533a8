"""Scheduler invariants with tiny sizes and no model: exact schedules, preemption, property tests."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.config import SchedulerConfig
from pagedllm.kv.manager import KVCacheManager
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams
from pagedllm.sched import Scheduler


def make(num_blocks: int = 10, block_size: int = 4, budget: int = 16, seqs: int = 8,
         max_len: int = 40, caching: bool = False, mode: str = "recompute",
         host_blocks: int = 0) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching,
                        num_host_blocks=host_blocks)
    return Scheduler(SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget,
                                     max_model_len=max_len, preemption_mode=mode), kv)


def req(rid: str, n_prompt: int, max_tokens: int = 4, priority: int = 0, base: int = 100) -> Request:
    return Request(rid, list(range(base, base + n_prompt)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   max_model_len=40, priority=priority)


def run_step(s: Scheduler, token: int = 7) -> tuple[dict[str, int], list[str]]:
    out = s.schedule()
    sampled = {x.request.request_id: token for x in out.scheduled if x.samples}
    s.update(out, sampled)
    s.kv.check_integrity()
    return {x.request.request_id: x.num_new_tokens for x in out.scheduled}, out.preempted


def test_chunked_prefill_and_decode_share_the_budget() -> None:
    s = make(budget=16)
    for i in range(3):
        s.add_request(req(f"r{i}", 10))
    assert run_step(s)[0] == {"r0": 10, "r1": 6}  # r1's prompt is split
    assert run_step(s)[0] == {"r0": 1, "r1": 4, "r2": 10}  # r0 decodes beside two prefills
    assert run_step(s)[0] == {"r0": 1, "r1": 1, "r2": 1}
    assert s.requests["r0"].num_output_tokens == 3


def test_max_num_seqs() -> None:
    s = make(seqs=2, num_blocks=20)
    for i in range(3):
        s.add_request(req(f"r{i}", 2))
    assert set(run_step(s)[0]) == {"r0", "r1"}
    assert s.num_waiting == 1


def test_preempts_latest_arrival_by_recompute_and_resumes() -> None:
    # 6 blocks of 4 = 24 slots. Two prompts of 8 take 2 blocks each (+1 each to decode).
    s = make(num_blocks=6, budget=32)
    s.add_request(req("a", 8, max_tokens=12))
    s.add_request(req("b", 8, max_tokens=12, base=200))
    preempted_seen = []
    for _ in range(60):
        if not s.has_unfinished_requests():
            break
        _, pre = run_step(s)
        preempted_seen += pre
    assert not s.has_unfinished_requests()
    assert preempted_seen and set(preempted_seen) == {"b"}  # b arrived later
    assert s.kv.num_free_blocks == 6
    assert s.num_preemptions == len(preempted_seen)


def test_priority_orders_admission_and_victims() -> None:
    s = make(num_blocks=6, budget=8, seqs=1)
    s.add_request(req("low", 4, priority=5))
    s.add_request(req("high", 4, priority=0, base=300))
    assert set(run_step(s)[0]) == {"high"}
    # victims: "low" arrived first, so arrival order alone would preempt "high"
    s = make(num_blocks=6, budget=32)
    s.add_request(req("low", 8, max_tokens=12, priority=5))
    s.add_request(req("high", 8, max_tokens=12, priority=0, base=200))
    preempted: list[str] = []
    high_steps = 0
    while s.has_unfinished_requests():
        sched, pre = run_step(s)
        preempted += pre
        high_steps += "high" in sched
    assert preempted and set(preempted) == {"low"}
    assert high_steps == 12  # prompt + 11 decodes: "high" ran every step until it finished
    assert s.kv.num_free_blocks == 6


def test_an_urgent_arrival_preempts_the_least_urgent_running_request() -> None:
    s = make(num_blocks=6, budget=32)
    s.add_request(req("mid", 10, max_tokens=8, priority=3))
    s.add_request(req("low", 10, max_tokens=8, priority=5, base=200))
    assert run_step(s)[0] == {"mid": 10, "low": 10}  # 3 blocks each: the pool is full
    s.add_request(req("urgent", 4, priority=0, base=300))
    sched, pre = run_step(s)
    assert pre == ["low"] and sched == {"mid": 1, "urgent": 4}  # not "mid", more urgent than "low"
    assert s.preemptions_by_kind["priority"] == 1


def test_prompt_that_can_never_fit_fails_at_once() -> None:
    s = make(num_blocks=3, block_size=4, max_len=40)
    with pytest.raises(ValueError, match="KV blocks"):
        s.add_request(req("big", 20))
    with pytest.raises(ValueError, match="max_model_len"):
        make(num_blocks=30).add_request(req("long", 40))
    with pytest.raises(ValueError, match="empty"):
        s.add_request(req("empty", 0))
    assert not s.has_unfinished_requests() and s.kv.num_free_blocks == 3


def test_abort_returns_blocks_wherever_the_request_is() -> None:
    s = make(num_blocks=10, seqs=1)
    s.add_request(req("run", 6))
    s.add_request(req("wait", 6, base=300))
    run_step(s)
    assert s.finish_request("run", RequestStatus.FINISHED_ABORTED) is not None
    assert s.finish_request("wait", RequestStatus.FINISHED_ABORTED) is not None
    assert s.finish_request("gone", RequestStatus.FINISHED_ABORTED) is None
    assert s.kv.num_free_blocks == 10 and not s.has_unfinished_requests()


def test_prefix_hits_skip_computation() -> None:
    s = make(num_blocks=20, budget=64, caching=True)
    s.add_request(req("a", 12, max_tokens=1))
    run_step(s)  # a finishes after one token; its 3 full blocks stay cached
    s.add_request(req("b", 12, max_tokens=1))
    sched, _ = run_step(s)
    assert sched == {"b": 4}  # 8 tokens hit (capped below the 12-token prompt), 4 computed


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 10), st.integers(0, 2)),
                     min_size=1, max_size=8),
    num_blocks=st.integers(8, 24),
    block_size=st.sampled_from([1, 2, 4, 8]),
    budget=st.integers(1, 48),
    seqs=st.integers(1, 5),
    caching=st.booleans(),
    mode=st.sampled_from(["recompute", "swap", "auto"]),
    host_blocks=st.integers(0, 30),
    n=st.integers(1, 3),
)
def test_random_workloads_finish_and_return_every_block(
    prompts: list[tuple[int, int, int]], num_blocks: int, block_size: int, budget: int, seqs: int,
    caching: bool, mode: str, host_blocks: int, n: int,
) -> None:
    max_len = 40
    if -(-max_len // block_size) > num_blocks:
        max_len = num_blocks * block_size
    s = make(num_blocks, block_size, budget, seqs, max_len, caching, mode, host_blocks)
    expected = {}
    for i, (n_tok, mt, prio) in enumerate(prompts):
        n_tok = min(n_tok, max_len - 1)
        sp = SamplingParams(max_tokens=mt, ignore_eos=True)
        group = [Request(f"r{i}" + (f"#{c}" if c else ""), [(i * 7 + j) % 5 for j in range(n_tok)],
                         sp, max_model_len=max_len, priority=prio) for c in range(n)]
        s.add_request(group[0], forks=group[1:])
        for r in group:
            expected[r.request_id] = (r, min(mt, max_len - n_tok))
    for _ in range(2000):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        assert out.num_batched_tokens <= budget
        assert out.scheduled or out.preempted or out.swap_in, "a step must make progress"
        assert len(s.running) <= max(seqs, n)
        s.update(out, {x.request.request_id: 3 for x in out.scheduled if x.samples})
        s.kv.check_integrity()
    assert not s.has_unfinished_requests()
    assert s.kv.num_free_blocks == num_blocks and s.kv.num_free_host_blocks == host_blocks
    for r, n_out in expected.values():
        assert r.num_output_tokens == n_out and r.status == RequestStatus.FINISHED_LENGTH


# -- priorities: reserved blocks, preemption of less urgent requests ---------------------------
def make_prio(num_blocks: int = 10, seqs: int = 8, reserved: float = 0.2, budget: int = 64,
              caching: bool = False) -> Scheduler:
    kv = KVCacheManager(num_blocks, 4, enable_prefix_caching=caching)
    return Scheduler(SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget,
                                     max_model_len=40, reserved_fraction=reserved), kv)


def test_reserved_blocks_are_only_for_the_urgent_class() -> None:
    s = make_prio(reserved=0.2)  # 2 of 10 blocks reserved
    assert s.reserved_blocks == 2
    s.add_request(req("low1", 12, priority=1))
    s.add_request(req("low2", 20, priority=1, base=200))
    s.add_request(req("u", 8, priority=0, base=300))
    sched, _ = run_step(s)
    # u (urgent) goes first and takes 2 blocks; low1 takes 3; low2 needs 5 but only 5 - 2 are
    # outside the reserve, so it waits although 5 blocks are free.
    assert sched == {"u": 8, "low1": 12}
    assert s.kv.num_free_blocks == 5 and s.num_waiting == 1
    s.add_request(req("u2", 16, priority=-1, base=400))  # more urgent still: may use the reserve
    sched, _ = run_step(s)
    assert "u2" in sched and "low2" not in sched


def test_lone_less_urgent_request_may_use_the_reserve() -> None:
    s = make_prio(num_blocks=10, reserved=0.5)
    s.add_request(req("low", 30, priority=3, max_tokens=8))  # needs 8 blocks > 10 - 5
    for _ in range(20):
        if not s.has_unfinished_requests():
            break
        run_step(s)
    assert not s.has_unfinished_requests() and s.kv.num_free_blocks == 10


def test_urgent_arrival_preempts_less_urgent_running_requests() -> None:
    s = make_prio(num_blocks=10, seqs=2, reserved=0.0)
    s.add_request(req("low0", 8, priority=5, max_tokens=20))
    s.add_request(req("low1", 8, priority=5, max_tokens=20, base=200))
    run_step(s)
    run_step(s)
    s.add_request(req("u", 8, priority=0, base=300, max_tokens=2))
    sched, pre = run_step(s)
    assert pre == ["low1"] and "u" in sched and "low1" not in sched  # no seat: low1 gives its own
    assert s.preemptions_by_kind["priority"] == 1
    # memory: low0 holds 3 blocks; a long urgent prompt takes the rest by preempting low0 too
    s2 = make_prio(num_blocks=6, seqs=4, reserved=0.0)
    s2.add_request(req("low", 16, priority=2, max_tokens=6))
    run_step(s2)
    s2.add_request(req("u", 20, priority=0, base=300, max_tokens=2))
    sched, pre = run_step(s2)
    assert pre == ["low"] and sched == {"u": 20}
    while s2.has_unfinished_requests():
        run_step(s2)
    assert s2.requests == {} and s2.kv.num_free_blocks == 6


def test_equal_priority_never_preempts_for_admission() -> None:
    s = make_prio(num_blocks=10, seqs=1, reserved=0.0)
    s.add_request(req("a", 8, priority=1))
    run_step(s)
    s.add_request(req("b", 8, priority=1, base=200))
    sched, pre = run_step(s)
    assert pre == [] and sched == {"a": 1}
