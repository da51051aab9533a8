"""Sliding-window KV: blocks leaving the window are freed, placeholders keep positions, windowed
prefix hits, fork / swap / compaction / trace with placeholders (block_size 4, exact ids)."""

from __future__ import annotations

import itertools

import pytest

from pagedllm.kv.manager import KVCacheManager, PrefixHit
from pagedllm.kv.trace import KVTracer, attach, replay
from pagedllm.kv.window import SlidingWindow, blocks_spanned, max_blocks_held


def make(window: int = 6, num_blocks: int = 10, caching: bool = True,
         host: int = 0) -> KVCacheManager:
    return KVCacheManager(num_blocks, 4, enable_prefix_caching=caching, num_host_blocks=host,
                          sliding_window=window)


def advance(m: KVCacheManager, rid: str, tokens: list[int], start: int, end: int) -> None:
    """What the scheduler does for a chunk [start, end): allocate, compute, hash, slide."""
    assert m.allocate_slots(rid, end)
    m.cache_blocks(rid, tokens, end)
    m.free_outside_window(rid, end)
    m.check_integrity()


def test_window_arithmetic_matches_brute_force() -> None:
    for window, bs in itertools.product(range(1, 12), (1, 2, 4, 8)):
        w = SlidingWindow(window, bs)
        for c in range(1, 60):
            needed = {p // bs for q in range(c, c + 3) for p in range(max(0, q - window + 1), q + 1)}
            first = w.first_needed_block(c)
            assert first <= min(needed) and first <= (c - 1) // bs
            # every block before ``first`` is unreadable by any later query
            assert first == min(min(needed), (c - 1) // bs)
        for n in range(1, 20):  # worst-case span of n positions over every alignment
            assert blocks_spanned(n, bs) == max(len({p // bs for p in range(s, s + n)})
                                                for s in range(bs))
        assert max_blocks_held(window, bs) <= -(-window // bs) + 1


def test_blocks_before_the_window_are_freed_and_reused() -> None:
    m = make(window=6)
    tokens = list(range(100, 130))
    advance(m, "a", tokens, 0, 8)  # positions 0..7; the next query (8) sees 3..8
    assert m.block_table("a") == [0, 1] and m.num_skipped_blocks("a") == 0
    advance(m, "a", tokens, 8, 9)  # the next query (9) sees 4..9: block 0 (0..3) is out
    assert m.num_skipped_blocks("a") == 1 and m.held_blocks("a") == [1, 2]
    assert m.block_table("a") == [1, 1, 2]  # the placeholder reads as the first held block
    assert m.pool.blocks[0].ref_cnt == 0 and m.pool.blocks[0].block_hash is not None  # cached
    for c in range(9, 29):
        advance(m, "a", tokens, c, c + 1)
        assert len(m.held_blocks("a")) <= max_blocks_held(6, 4)
    assert m.num_skipped_blocks("a") == (29 - 6 + 1) // 4
    assert len(m.block_table("a")) == 8  # positions stay addressable
    assert m.num_used_blocks == len(m.held_blocks("a")) == 2
    m.free("a")
    assert m.num_free_blocks == m.num_blocks
    m.check_integrity()


def test_freed_blocks_are_hashed_once_and_never_after_they_left() -> None:
    m = make(window=2)
    tokens = list(range(16))
    assert m.allocate_slots("a", 16)
    m.free_outside_window("a", 16)  # freed before anything was hashed
    assert m.num_skipped_blocks("a") == 3 and m.held_blocks("a") == [3]
    m.cache_blocks("a", tokens, 16)
    assert [b.block_hash is not None for b in m.pool.blocks[:4]] == [False, False, False, True]
    assert len(m.block_hashes("a")) == 4  # the chain went on through the freed positions
    m.check_integrity()


def test_windowed_prefix_hit_holds_only_the_window() -> None:
    m = make(window=6, num_blocks=12)
    prompt = list(range(200, 222))  # 22 tokens: 5 full blocks
    advance(m, "a", prompt, 0, 22)
    assert m.num_skipped_blocks("a") == 4 and m.held_blocks("a") == [4, 5]
    m.free("a")
    hit = m.find_prefix(prompt)  # may cover 21 tokens -> 5 blocks; needs keys >= 20 - 6 + 1
    assert (hit.num_tokens, hit.num_skipped, hit.blocks) == (20, 3, [3, 4])
    assert m.num_blocks_needed("b", 22, hit) == 2 + 1  # 2 revived + 1 new
    assert m.allocate_slots("b", 22, hit)
    assert m.num_skipped_blocks("b") == 3 and m.held_blocks("b")[:2] == [3, 4]
    assert m.block_hashes("b")[:3] == [None, None, None]
    m.cache_blocks("b", prompt, 22)
    m.check_integrity()
    # a full-attention manager would have needed the whole chain (blocks 0..2 are evictable)
    full = KVCacheManager(12, 4)
    advance_full = full.find_prefix(prompt)
    assert advance_full.blocks == [] and advance_full.num_skipped == 0


def test_windowed_hit_survives_eviction_of_blocks_before_the_window() -> None:
    m = make(window=6, num_blocks=8)
    prompt = list(range(300, 322))
    advance(m, "a", prompt, 0, 22)
    m.free("a")  # cached-free, LRU order: blocks 0..3 (freed by the window) first, then 5, 4
    assert m.pool.free_queue.ids() == [6, 7, 0, 1, 2, 3, 5, 4]
    assert m.allocate_slots("x", 8) and m.held_blocks("x") == [6, 7]
    assert m.allocate_slots("y", 12) and m.held_blocks("y") == [0, 1, 2]  # evicts blocks 0..2
    hit = m.find_prefix(prompt)
    assert (hit.num_skipped, hit.blocks) == (3, [3, 4])  # still a hit: 3 and 4 are cached
    assert m.allocate_slots("y", 16) and m.held_blocks("y") == [0, 1, 2, 3]  # evicts block 3
    assert m.find_prefix(prompt) == PrefixHit([], 0, (), 0)  # 4 alone: its window is gone
    m.check_integrity()


def test_stale_or_overreaching_windowed_prefix_is_refused() -> None:
    m = make(window=6, num_blocks=12)
    prompt = list(range(22))
    advance(m, "a", prompt, 0, 22)
    hit = m.find_prefix(prompt)
    greedy = hit._replace(blocks=hit.blocks[1:], num_skipped=hit.num_skipped + 1)
    with pytest.raises(ValueError, match="still needs"):
        m.allocate_slots("b", 22, greedy)
    with pytest.raises(ValueError, match="claims"):
        m.allocate_slots("b", 22, hit._replace(num_skipped=0))
    assert not m.has_request("b")
    m.check_integrity()


def test_fork_shares_placeholders_and_copies_the_partial_block() -> None:
    m = make(window=6, num_blocks=12)
    tokens = list(range(30))
    advance(m, "p", tokens, 0, 18)  # positions 0..17; skip (18 - 5) // 4 = 3
    assert m.num_skipped_blocks("p") == 3 and m.held_blocks("p") == [3, 4]
    m.fork("p", "c", 18)
    assert m.num_skipped_blocks("c") == 3 and m.held_blocks("c") == [3, 4]
    assert [b.ref_cnt for b in m.pool.blocks[3:5]] == [2, 2]
    assert m.allocate_slots("c", 19)  # writes into the shared partial block 4: copy it
    assert m.held_blocks("c") == [3, 5] and m.take_block_copies() == [(4, 5)]
    m.check_integrity()
    with pytest.raises(ValueError, match="before its first held block"):
        m.fork("p", "d", 8)


def test_cow_mark_follows_a_slide() -> None:
    m = make(window=6, num_blocks=12)
    tokens = list(range(30))
    advance(m, "p", tokens, 0, 13)
    m.fork("p", "c", 13)  # the shared partial block 3 is c's held block 1
    assert m.held_blocks("c") == [2, 3]
    assert m.free_outside_window("c", 17) == 1  # (not a scheduler order: c never wrote)
    assert m.held_blocks("c") == [3]
    assert m.allocate_slots("c", 17)
    assert m.held_blocks("c") == [4, 5] and m.take_block_copies() == [(3, 4)]
    m.check_integrity()


def test_swap_out_and_in_moves_only_held_blocks() -> None:
    m = make(window=6, num_blocks=10, host=4)
    tokens = list(range(40))
    advance(m, "a", tokens, 0, 25)
    held = m.held_blocks("a")
    assert m.num_skipped_blocks("a") == 5 and len(held) == 2
    assert m.swap_out("a") == [(held[0], 0), (held[1], 1)]
    assert m.is_swapped("a") and m.num_free_blocks == 10
    m.check_integrity()
    pairs = m.swap_in("a")
    assert pairs is not None and len(pairs) == 2
    assert m.num_skipped_blocks("a") == 5 and len(m.block_table("a")) == 7
    advance(m, "a", tokens, 25, 26)
    m.check_integrity()


def test_compaction_remaps_held_blocks_only() -> None:
    m = make(window=6, num_blocks=10)
    tokens = list(range(40))
    assert m.allocate_slots("x", 16)  # blocks 0..3
    advance(m, "a", tokens, 0, 8)  # blocks 4, 5
    for c in range(8, 30):
        advance(m, "a", tokens, c, c + 1)
    assert min(m.held_blocks("a")) > 3
    m.free("x")
    moves = m.compact()
    assert m.held_blocks("a") == [0, 1] and len(moves) == 2
    assert m.block_table("a")[:m.num_skipped_blocks("a")] == [0] * m.num_skipped_blocks("a")
    m.check_integrity()


def test_trace_of_a_windowed_run_replays_exactly() -> None:
    tracer = KVTracer()
    m = make(window=6, num_blocks=12, host=4)
    attach(m, tracer)
    prompt = list(range(500, 522))
    advance(m, "a", prompt, 0, 22)
    m.free("a")
    hit = m.find_prefix(prompt)
    assert m.allocate_slots("b", 22, hit)
    m.cache_blocks("b", prompt, 22)
    for c in range(22, 30):
        advance(m, "b", prompt + list(range(8)), c, c + 1)
    m.fork("b", "c", 30)
    assert m.swap_out("c") is not None and m.swap_in("c") is not None
    m.free("b")
    m.free("c")
    ops = {e["op"] for e in tracer.events}
    assert {"free_window", "prefix_hit", "swap_out"} <= ops
    assert any(e.get("skipped") for e in tracer.events if e["op"] == "allocate")
    kv = replay(tracer.events)
    assert kv.sliding_window == 6 and kv.pool.free_queue.ids() == m.pool.free_queue.ids()


def test_no_window_no_freeing() -> None:
    m = KVCacheManager(10, 4)
    assert m.allocate_slots("a", 30)
    assert m.free_outside_window("a", 30) == 0 and len(m.held_blocks("a")) == 8
    with pytest.raises(ValueError, match="sliding_window=0"):
        make(window=0)
