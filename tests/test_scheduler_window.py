"""The scheduler over a sliding-window KV manager, no model: held blocks stay bounded by the
window through long generations, prefill chunks shrink to the free blocks, preemption works."""

from __future__ import annotations

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.kv.manager import KVCacheManager
from pagedllm.kv.window import max_blocks_held
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams
from pagedllm.sched import Scheduler


def make(num_blocks: int, block_size: int, window: int | None, budget: int = 2048,
         max_len: int = 4096, mode: str = "recompute", host_blocks: int = 0,
         caching: bool = True, seqs: int = 8) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching,
                        num_host_blocks=host_blocks, sliding_window=window)
    return Scheduler(SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget,
                                     max_model_len=max_len, preemption_mode=mode,
                                     reserved_fraction=0.0), kv)


def req(rid: str, n_prompt: int, max_tokens: int, base: int = 100) -> Request:
    return Request(rid, [base + i % 50 for i in range(n_prompt)],
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), max_model_len=4096)


def run(s: Scheduler, bound: int | None = None) -> int:
    """Step to the end (every sampled token 7); check integrity and the per-request bound of
    held blocks after every step. Returns the number of steps."""
    steps = 0
    while s.has_unfinished_requests():
        out = s.schedule()
        assert not out.is_empty, "no progress"
        if bound is not None:
            for x in out.scheduled:  # while the step runs: the window plus the new tokens
                held = len(s.kv.held_blocks(x.request.request_id))
                assert held <= max_blocks_held(s.kv.sliding_window, s.kv.block_size,
                                               x.num_new_tokens)
        s.update(out, {x.request.request_id: 7 for x in out.scheduled if x.samples})
        s.kv.check_integrity()
        if bound is not None:
            for r in s.running:
                assert len(s.kv.held_blocks(r.request_id)) <= bound
        steps += 1
    assert s.kv.num_free_blocks == s.kv.num_blocks
    return steps


@pytest.mark.parametrize("block_size", [1, 16])
def test_2000_token_generation_holds_only_its_window(block_size: int) -> None:
    window = 32
    bound = -(-window // block_size) + 2
    s = make(num_blocks=4 * bound, block_size=block_size, window=window)
    for i in range(3):  # three long generations at once, in a pool of 4 windows
        s.add_request(req(f"r{i}", 20 + i, 2000, base=100 * i))
    run(s, bound)
    assert s.num_preemptions == 0


def test_without_the_window_the_same_pool_preempts() -> None:
    s = make(num_blocks=4 * 4, block_size=16, window=None, max_len=4096)
    s.add_request(req("r0", 20, 200))
    s.add_request(req("r1", 20, 200, base=300))
    run(s)
    assert s.num_preemptions > 0


def test_long_prompt_prefills_in_chunks_that_fit() -> None:
    s = make(num_blocks=6, block_size=16, window=32)
    s.add_request(req("a", 600, 10))  # 38 blocks if held whole; the pool has 6
    out = s.schedule()
    (x,) = out.scheduled
    assert x.num_new_tokens == 6 * 16  # the first chunk fills the pool, no more
    s.update(out, {})
    assert s.kv.num_skipped_blocks("a") == 4 and len(s.kv.held_blocks("a")) == 2
    run(s, 6)
    full = make(num_blocks=6, block_size=16, window=None)
    with pytest.raises(ValueError, match="needs 38 KV blocks"):
        full.add_request(req("a", 600, 10))


def test_without_chunked_prefill_a_prompt_must_fit_whole() -> None:
    kv = KVCacheManager(6, 16, sliding_window=32)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=4096, max_model_len=4096,
                                  enable_chunked_prefill=False), kv)
    with pytest.raises(ValueError, match="needs 38 KV blocks"):
        s.add_request(req("a", 600, 10))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_of_windowed_requests(mode: str) -> None:
    s = make(num_blocks=10, block_size=4, window=8, budget=24, mode=mode,
             host_blocks=40 if mode == "swap" else 0)
    for i in range(5):
        s.add_request(req(f"r{i}", 30 + 3 * i, 40, base=10 * i))
    run(s, max_blocks_held(8, 4, 24))
    assert s.num_preemptions > 0
    assert s.preemptions_by_kind[mode] > 0


def test_recomputed_windowed_request_hits_its_own_window() -> None:
    s = make(num_blocks=40, block_size=4, window=8, budget=64)
    s.add_request(req("a", 40, 4))
    out = s.schedule()
    s.update(out, {x.request.request_id: 7 for x in out.scheduled if x.samples})
    s._preempt(s.running[0], out)  # recompute: blocks freed but still cached
    out = s.schedule()
    (x,) = out.scheduled
    assert x.start == 40 and s.kv.num_skipped_blocks("a") == 8  # only the window was revived
    s.kv.check_integrity()
