"""KVCacheManager: exact block ids, ref counts, prefix hits, eviction order (block_size 4)."""

from __future__ import annotations

import pytest

import pagedllm.kv.prefix as prefix_mod
from pagedllm.kv.manager import KVCacheManager, PrefixHit


def make(num_blocks: int = 10, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, 4, enable_prefix_caching=caching)


def refs(m: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in m.pool.blocks]


def snapshot(m: KVCacheManager) -> tuple:
    return (m.pool.free_queue.ids(), refs(m), dict(m.pool.cached),
            [b.block_hash for b in m.pool.blocks],
            {r: m.block_table(r) for r in m.tables.held},
            {r: list(h) for r, h in m.tables.hashes.items()})


def run_prompt(m: KVCacheManager, rid: str, tokens: list[int]) -> PrefixHit:
    """Admit a request as the scheduler does and compute its whole prompt."""
    hit = m.find_prefix(tokens)
    assert m.allocate_slots(rid, len(tokens), hit)
    m.cache_blocks(rid, tokens, len(tokens))
    m.check_integrity()
    return hit


A = list(range(100, 110))  # 10 tokens: 2 full blocks + 2 tokens


def test_allocate_exact_block_ids() -> None:
    m = make()
    assert m.num_blocks_needed("a", 9) == 3
    assert m.allocate_slots("a", 9)
    assert m.block_table("a") == [0, 1, 2] and m.has_request("a")
    assert m.allocate_slots("a", 12)  # still fits in 3 blocks
    assert m.block_table("a") == [0, 1, 2]
    assert m.num_blocks_needed("a", 13) == 1
    assert m.allocate_slots("a", 13)
    assert m.allocate_slots("b", 4)
    assert m.block_table("a") == [0, 1, 2, 3] and m.block_table("b") == [4]
    assert m.num_free_blocks == 5 and m.usage == pytest.approx(0.5)
    assert refs(m) == [1] * 5 + [0] * 5
    m.check_integrity()


def test_block_table_is_a_copy_and_unknown_request_raises() -> None:
    m = make()
    m.allocate_slots("a", 4)
    m.block_table("a").append(99)
    assert m.block_table("a") == [0]
    with pytest.raises(KeyError, match="no blocks allocated for request 'zz'"):
        m.block_table("zz")
    assert not m.has_request("zz")


def test_prefix_hit_reuses_exact_block_ids_after_free() -> None:
    m = make()
    assert run_prompt(m, "a", A) == PrefixHit([], 0, ())
    assert m.block_table("a") == [0, 1, 2]
    assert [b.block_hash is not None for b in m.pool.blocks[:3]] == [True, True, False]
    m.free("a")
    assert m.pool.free_queue.ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    assert m.num_free_blocks == 10 and m.usage == 0.0
    hit = m.find_prefix(A)
    assert hit.blocks == [0, 1] and hit.num_tokens == 8
    assert m.num_blocks_needed("b", 10, hit) == 3  # 2 revived + 1 new
    assert m.allocate_slots("b", 10, hit)
    assert m.block_table("b") == [0, 1, 3]
    assert m.pool.free_queue.ids() == [4, 5, 6, 7, 8, 9, 2]
    m.check_integrity()


def test_prefix_blocks_are_shared_by_reference() -> None:
    m = make()
    run_prompt(m, "a", A)
    hit = run_prompt(m, "b", A + [7, 7])
    assert hit.blocks == [0, 1]
    assert m.block_table("a") == [0, 1, 2] and m.block_table("b") == [0, 1, 3]
    assert refs(m)[:4] == [2, 2, 1, 1]
    m.free("a")
    assert refs(m)[:4] == [1, 1, 0, 1] and m.pool.free_queue.ids() == list(range(4, 10)) + [2]
    m.free("b")
    assert refs(m) == [0] * 10
    assert m.pool.free_queue.ids() == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]
    m.check_integrity()


def test_eviction_is_lru_deepest_block_first() -> None:
    m = make()
    prompt = list(range(13))  # blocks 0, 1, 2 full and cached; block 3 holds one token
    run_prompt(m, "a", prompt)
    m.free("a")
    assert m.pool.free_queue.ids() == [4, 5, 6, 7, 8, 9, 3, 2, 1, 0]
    assert m.allocate_slots("x", 24) and m.block_table("x") == [4, 5, 6, 7, 8, 9]
    assert m.allocate_slots("y", 4) and m.block_table("y") == [3]  # unhashed partial block
    assert m.find_prefix(prompt).blocks == [0, 1, 2]
    assert m.allocate_slots("z", 4) and m.block_table("z") == [2]  # deepest cached block
    assert m.find_prefix(prompt).blocks == [0, 1]
    assert m.pool.blocks[2].block_hash is None and len(m.pool.cached) == 2
    assert m.allocate_slots("w", 4) and m.block_table("w") == [1]
    assert m.find_prefix(prompt).blocks == [0]
    m.check_integrity()


def test_hit_is_capped_at_len_minus_one_tokens() -> None:
    m = make()
    run_prompt(m, "a", list(range(12)))  # blocks 0, 1, 2 all cached
    hit = m.find_prefix(list(range(8)))  # 7 tokens may hit: 1 full block
    assert (hit.blocks, hit.num_tokens) == ([0], 4)
    assert m.find_prefix(list(range(9))).blocks == [0, 1]
    assert m.find_prefix(list(range(12))).blocks == [0, 1]  # exactly 3 blocks: hit 2
    assert m.find_prefix(list(range(13))).blocks == [0, 1, 2]
    assert m.find_prefix(list(range(4))).blocks == []
    assert m.find_prefix([0]).blocks == [] and m.find_prefix([]).blocks == []


def test_partial_and_uncomputed_blocks_are_never_shared() -> None:
    m = make()
    tokens = list(range(10))
    assert m.allocate_slots("a", 10)
    m.cache_blocks("a", tokens, 7)  # chunked prefill: only block 0 is full and computed
    assert [b.block_hash is not None for b in m.pool.blocks[:3]] == [True, False, False]
    assert m.find_prefix(tokens + [1, 2, 3]).blocks == [0]
    m.cache_blocks("a", tokens, 10)
    assert m.find_prefix(tokens + [1, 2, 3]).blocks == [0, 1]  # block 2 (2 tokens) never
    m.cache_blocks("a", tokens + [5, 5], 12)  # slots only cover 12 tokens: block 2 now full
    assert m.find_prefix(tokens + [5, 5, 9]).blocks == [0, 1, 2]
    m.check_integrity()


def test_each_block_is_hashed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, ...]] = []
    real = prefix_mod.hash_block_tokens

    def counting(parent, token_ids, extra_keys):
        calls.append(token_ids)
        return real(parent, token_ids, extra_keys)

    monkeypatch.setattr(prefix_mod, "hash_block_tokens", counting)
    m = make()
    tokens = list(range(6))
    m.allocate_slots("a", 6)
    for n in range(1, 7):
        m.cache_blocks("a", tokens[:n], n)
    assert calls == [(0, 1, 2, 3)]
    for n in range(7, 13):
        tokens.append(n - 1)
        m.allocate_slots("a", n)
        m.cache_blocks("a", tokens, n)
    assert calls == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]


def test_allocate_failure_changes_nothing_and_counts_evictable_prefix_blocks() -> None:
    m = make()
    prompt = list(range(9))  # 3 blocks; blocks 0, 1 cached
    run_prompt(m, "a", prompt)
    m.free("a")  # free queue: 3..9, 2, 1, 0
    assert m.allocate_slots("c", 32) and m.block_table("c") == [3, 4, 5, 6, 7, 8, 9, 2]
    hit = m.find_prefix(prompt)
    assert hit.blocks == [0, 1] and m.num_free_blocks == 2
    assert m.num_blocks_needed("b", 9, hit) == 3  # the 2 evictable hit blocks count
    before = snapshot(m)
    assert not m.allocate_slots("b", 9, hit)
    assert snapshot(m) == before and not m.has_request("b")
    assert not m.allocate_slots("c", 41)  # growing an existing request: 3 more, 2 free
    assert snapshot(m) == before
    m.free("c")
    assert m.allocate_slots("b", 9, m.find_prefix(prompt))
    assert m.block_table("b") == [0, 1, 2]
    m.check_integrity()


def test_hit_on_running_request_needs_no_free_blocks() -> None:
    m = make()
    prompt = list(range(9))
    run_prompt(m, "a", prompt)
    assert m.allocate_slots("c", 28) and m.num_free_blocks == 0
    hit = m.find_prefix(prompt)
    assert hit.blocks == [0, 1] and m.num_blocks_needed("b", 8, hit) == 0
    assert m.allocate_slots("b", 8, hit) and m.block_table("b") == [0, 1]
    assert not m.allocate_slots("b", 9)
    assert refs(m)[:3] == [2, 2, 1]
    m.check_integrity()


def test_hash_collision_never_gives_a_wrong_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefix_mod, "hash_block_tokens", lambda parent, tokens, extra: 0)
    m = make()
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    run_prompt(m, "a", a)
    # Both full blocks hash to 0: the index keeps block 0, block 1 stays unregistered.
    assert list(m.pool.cached) == [0] and m.pool.cached[0].block_id == 0
    assert m.pool.blocks[1].block_hash is None
    assert m.find_prefix([9, 9, 9, 9, 5, 6, 7, 8, 9]).blocks == []  # same value, other tokens
    assert m.find_prefix(a).blocks == [0]  # block 1's lookup finds block 0: parent differs
    assert m.find_prefix([1, 2, 3, 4, 1, 2, 3, 4, 0]).blocks == [0]  # same tokens, not root
    m.check_integrity()


def test_extra_keys_separate_caches() -> None:
    m = make()
    hit = m.find_prefix(A, extra_keys=("lora-1",))
    assert m.allocate_slots("a", 10, hit)
    m.cache_blocks("a", A, 10, extra_keys=("lora-1",))
    assert m.find_prefix(A).blocks == []
    assert m.find_prefix(A, extra_keys=("lora-2",)).blocks == []
    assert m.find_prefix(A, extra_keys=("lora-1",)).blocks == [0, 1]


def test_identical_blocks_computed_twice_keep_the_first_in_the_index() -> None:
    m = make()
    assert m.allocate_slots("a", 10) and m.allocate_slots("b", 10)  # neither cached yet
    m.cache_blocks("a", A, 10)
    m.cache_blocks("b", A, 10)
    assert {h: b.block_id for h, b in m.pool.cached.items()} == {
        h.value: i for i, h in enumerate(m.tables.hashes["a"])}
    # b keeps its chain: its own later blocks link on
    assert m.tables.hashes["b"] == m.tables.hashes["a"]
    assert [b.block_hash for b in m.pool.blocks[3:6]] == [None, None, None]
    m.free("a")
    m.free("b")
    assert m.find_prefix(A).blocks == [0, 1]
    m.check_integrity()


def test_caching_disabled() -> None:
    m = make(caching=False)
    run_prompt(m, "a", A)
    assert m.pool.cached == {} and all(b.block_hash is None for b in m.pool.blocks)
    m.free("a")
    assert m.find_prefix(A) == PrefixHit([], 0)
    assert m.stats.queries == 0
    assert m.allocate_slots("b", 10, m.find_prefix(A))
    assert m.block_table("b") == [3, 4, 5]  # plain LRU reuse, no hits
    with pytest.raises(ValueError, match="prefix caching is disabled"):
        m.allocate_slots("c", 10, PrefixHit([0], 4))
    m.check_integrity()


def test_free_is_idempotent_and_unknown_ids_are_noops() -> None:
    m = make()
    m.allocate_slots("a", 5)
    m.free("a")
    m.free("a")
    m.free("never-seen")
    m.cache_blocks("never-seen", A, 10)
    assert m.num_free_blocks == 10 and not m.has_request("a")
    m.check_integrity()


def test_prefix_only_on_first_call_and_stale_prefix_rejected() -> None:
    m = make()
    run_prompt(m, "a", A)
    hit = m.find_prefix(A)
    with pytest.raises(ValueError, match="already has blocks"):
        m.allocate_slots("a", 12, hit)
    with pytest.raises(ValueError, match="below the prefix hit"):
        m.allocate_slots("b", 7, hit)
    with pytest.raises(ValueError, match="claims"):
        m.allocate_slots("b", 12, PrefixHit([0, 1], 4))
    m.free("a")
    assert m.allocate_slots("x", 40)  # evicts everything, including blocks 0 and 1
    m.free("x")
    before = snapshot(m)
    with pytest.raises(ValueError, match="stale prefix hit"):
        m.allocate_slots("b", 10, hit)
    assert snapshot(m) == before
    m.check_integrity()


def test_stale_prefix_detected_when_block_recached_with_other_content() -> None:
    m = make(num_blocks=3)
    run_prompt(m, "a", A)  # blocks 0, 1 cached
    hit = m.find_prefix(A)
    m.free("a")  # queue: 2, 1, 0
    run_prompt(m, "b", [7] * 12)  # takes 2, 1, 0 and caches 2, 1, 0 with other content
    m.free("b")
    with pytest.raises(ValueError, match="stale prefix hit"):
        m.allocate_slots("c", 10, hit)


def test_stats_and_reset_prefix_cache() -> None:
    m = make()
    run_prompt(m, "a", A)  # 10 tokens queried, 0 hit
    assert not m.reset_prefix_cache()  # "a" is running
    m.free("a")
    run_prompt(m, "b", A)  # 10 queried, 8 hit
    assert (m.stats.queries, m.stats.hits) == (20, 8)
    assert m.stats.hit_rate == pytest.approx(0.4)
    m.free("b")
    assert m.reset_prefix_cache()
    assert m.pool.cached == {} and m.find_prefix(A).blocks == []
    m.stats.reset()
    assert m.stats.hit_rate == 0.0
    m.check_integrity()


def test_manager_check_integrity_catches_wrong_ref_counts() -> None:
    m = make()
    m.allocate_slots("a", 8)
    m.pool.touch([m.pool.blocks[1]])  # a reference no table accounts for
    with pytest.raises(AssertionError, match="block 1: ref_cnt 2 != 1"):
        m.check_integrity()


def test_bad_block_size() -> None:
    with pytest.raises(ValueError, match="block_size must be positive"):
        KVCacheManager(10, 0)
