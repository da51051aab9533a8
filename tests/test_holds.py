"""Held KV (``pagedllm.sched.holds``): a finished request's blocks kept for ``keep_kv_s`` so a
``fork_of`` request starts on them. Tiny pools, no model: exact block ids and ref counts, expiry
on a fake clock, release by abort / pressure / shutdown, and every block back to the pool
(hypothesis). Through the engine core: the messages' fields and the abort path."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm import LLMEngine
from pagedllm.config import SchedulerConfig
from pagedllm.engine.messages import EngineCoreRequest, encoder, to_core_decoder
from pagedllm.kv.manager import KVCacheManager
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams
from pagedllm.sched import Scheduler


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make(num_blocks: int = 10, budget: int = 32) -> tuple[Scheduler, Clock]:
    kv = KVCacheManager(num_blocks, 4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget,
                                  max_model_len=40, reserved_fraction=0.0), kv)
    clock = Clock()
    s.holds.clock = clock
    return s, clock


def req(rid: str, tokens: list[int], keep: float | None = None, fork_of: str | None = None,
        max_tokens: int = 1) -> Request:
    r = Request(rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                max_model_len=40)
    r.keep_kv_s, r.fork_of = keep, fork_of
    return r


def run(s: Scheduler, token: int = 7) -> None:
    """Step until every request finished (tokens sampled: ``token``)."""
    for _ in range(100):
        if not s.requests:
            return
        out = s.schedule()
        s.update(out, {x.request.request_id: token for x in out.scheduled if x.samples})
        s.kv.check_integrity()
    raise AssertionError(f"not finished: {sorted(s.requests)}")


def test_a_fork_starts_on_the_held_blocks_shared_and_copies_the_partial_one() -> None:
    s, _ = make()
    s.add_request(req("a", list(range(10)), keep=5.0))  # 10 tokens: blocks of 4, 4, 2
    run(s)
    assert "a" in s.holds and s.kv.block_table("a") == [0, 1, 2]
    assert s.kv.num_free_blocks == 7  # held: the blocks stay out of the pool
    b = req("b", list(range(10)) + [7], fork_of="a", max_tokens=2)
    s.add_request(b)
    assert b.num_computed_tokens == 10 and b.status.value == "running" and b in s.running
    assert s.kv.block_table("b") == [0, 1, 2]
    assert [s.kv.pool.blocks[i].ref_cnt for i in (0, 1, 2)] == [2, 2, 2]
    out = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("b", 1)]
    assert out.kv.block_copies == [(2, 3)]  # the partial block copied before b writes into it
    s.update(out, {"b": 7})
    assert s.holds.release("a") and "a" not in s.holds
    run(s)
    assert s.kv.num_free_blocks == s.kv.num_blocks and not s.kv.has_request("a")


def test_a_hold_expires_and_a_late_fork_is_admitted_like_any_request() -> None:
    s, clock = make()
    s.add_request(req("a", list(range(6)), keep=2.0))
    run(s)
    clock.t = 1.9
    s.schedule()
    assert "a" in s.holds
    clock.t = 2.0
    s.schedule()
    assert "a" not in s.holds and s.kv.num_free_blocks == s.kv.num_blocks
    late = req("b", list(range(6)) + [7], fork_of="a")
    s.add_request(late)
    assert late.num_computed_tokens == 0 and s.num_waiting == 1  # recomputed
    run(s)
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_only_a_normal_finish_is_held_and_a_wrong_prefix_is_refused() -> None:
    s, _ = make()
    s.add_request(req("a", list(range(6)), keep=5.0, max_tokens=3))
    s.schedule()
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert "a" not in s.holds and s.kv.num_free_blocks == s.kv.num_blocks
    s.add_request(req("h", list(range(6)), keep=5.0))
    run(s)
    with pytest.raises(ValueError, match="must extend that request's 6 computed tokens"):
        s.add_request(req("x", [1, 2, 3, 4, 5, 6, 7], fork_of="h"))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(req("h", [1, 2]))
    assert not s.requests and s.kv.block_table("h") == [2, 3] and s.kv.num_free_blocks == 8


def test_a_short_pool_ends_holds_before_it_preempts() -> None:
    s, _ = make(num_blocks=4)
    s.add_request(req("a", list(range(8)), keep=60.0))  # 2 blocks held
    run(s)
    s.add_request(req("b", list(range(100, 112)), max_tokens=2))  # needs 3, then 4 blocks
    run(s)
    assert not s.holds and s.num_preemptions == 0
    assert s.kv.num_free_blocks == s.kv.num_blocks


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "fork", "fork", "step", "abort", "tick"]),
                          st.integers(0, 50)), max_size=40))
def test_random_holds_forks_and_aborts_give_every_block_back(ops: list[tuple[str, int]]) -> None:
    s, clock = make(num_blocks=12, budget=16)
    done: list[Request] = []  # finished requests, to fork from
    n = 0
    for op, x in ops:
        n += 1
        if op == "add":
            s.add_request(req(f"r{n}", list(range(x % 13 + 1)), keep=float(x % 4),
                              max_tokens=x % 3 + 1))
        elif op == "fork" and done:
            p = done[x % len(done)]
            s.add_request(req(f"r{n}", p.token_ids[:p.num_computed_tokens] + [x], keep=1.0,
                              fork_of=p.request_id, max_tokens=x % 2 + 1))
        elif op == "step":
            for _ in range(x % 6 + 1):
                out = s.schedule()
                done += s.update(out, {r.request.request_id: x for r in out.scheduled
                                       if r.samples})
        elif op == "abort":
            held = sorted(s.holds.held)
            if held:
                s.holds.release(held[x % len(held)])
        elif op == "tick":
            clock.t += x / 20
        s.kv.check_integrity()
        owners = [r for r in [*s.requests, *s.holds.held] if s.kv.has_request(r)]
        assert s.kv.num_free_blocks + len({b for r in owners for b in s.kv.held_blocks(r)}) == 12
    run(s)
    s.holds.release_all()
    s.kv.check_integrity()
    assert s.kv.num_free_blocks == s.kv.num_blocks and s.kv.num_requests == 0


def test_engine_core_keep_fork_abort_and_shutdown(tiny_models: dict[str, Path]) -> None:
    eng = LLMEngine.from_args(model=str(tiny_models["llama"]), block_size=4, num_kv_blocks=64,
                              max_model_len=64)
    core = eng.core
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=2)
    first = EngineCoreRequest(request_id="a", prompt_token_ids=[5, 6, 7, 8, 9],
                              sampling_params=sp, arrival_time=0.0, keep_kv_s=30.0)
    wire = to_core_decoder().decode(encoder().encode(first))  # crosses a process boundary
    assert wire == first
    core.add_request(wire)
    tok = core.step().outputs[0].new_token_ids[0]
    assert "a" in core.scheduler.holds and not core.has_unfinished_requests()
    with pytest.raises(ValueError, match="already in use"):
        core.add_request(first)
    with pytest.raises(ValueError, match="need n=1"):
        core.add_request(EngineCoreRequest(request_id="n", prompt_token_ids=[5],
                                           sampling_params=SamplingParams(n=2),
                                           arrival_time=0.0, fork_of="a"))
    core.add_request(EngineCoreRequest(request_id="b", prompt_token_ids=[5, 6, 7, 8, 9, tok],
                                       sampling_params=sp, arrival_time=0.0, fork_of="a",
                                       keep_kv_s=30.0))
    assert core.scheduler.requests["b"].num_computed_tokens == 5
    assert core.abort_requests(["a"]) == []  # a hold is no live request; its blocks go back
    assert "a" not in core.scheduler.holds
    out = core.step().outputs[0]
    assert out.request_id == "b" and out.num_cached_tokens == 5 and out.finish_reason == "length"
    assert "b" in core.scheduler.holds
    core.check_integrity()
    eng.shutdown()  # ends every hold
    assert not core.scheduler.holds and core.kv.num_free_blocks == core.kv.num_blocks
