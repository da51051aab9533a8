"""The inspector's picture of the KV manager (kv/snapshot.py) and the prefix-hit counts it shows,
on a 10-block pool with exact block ids; and the counts it derives equal the pool's own."""

from __future__ import annotations

from pagedllm.kv.block_pool import hash_hex
from pagedllm.kv.manager import KVCacheManager
from pagedllm.kv.snapshot import ORPHAN, ROOT, capture_kv, count_states

TOKENS = list(range(100, 110))  # 10 tokens: 2 full blocks of 4 + 2


def _pool_counts(kv: KVCacheManager) -> dict[str, int]:
    p = kv.pool
    return {"num_blocks": p.num_blocks, "free_blocks": p.num_free_blocks,
            "cached_blocks": p.num_cached_free_blocks, "used_blocks": p.num_used_blocks,
            "shared_blocks": p.num_shared_blocks, "lora_blocks": kv.adapters.num_blocks,
            "host_used_blocks": kv.num_host_blocks - kv.num_free_host_blocks}


def _check(kv: KVCacheManager) -> dict:
    kv.check_integrity()
    snap = capture_kv(kv)
    assert count_states(snap) == _pool_counts(kv)
    return snap


def test_states_tables_host_and_prefix_tree_step_by_step() -> None:
    kv = KVCacheManager(10, 4, True, num_host_blocks=4)
    assert kv.allocate_slots("a", 9)
    kv.cache_blocks("a", TOKENS[:9], 9)
    s = _check(kv)
    assert s["blocks"] == "hhu......." and s["refs"] == {} and s["host"] == "...."
    assert s["tables"] == {"a": [0, 1, 2]} and s["host_tables"] == {}
    h0, h1 = kv.block_hashes("a")
    assert s["prefix"] == [[0, ROOT, 0, hash_hex(h0.value)[:8]], [1, 0, 0, hash_hex(h1.value)[:8]]]

    hit = kv.find_prefix(TOKENS)
    assert hit.blocks == [0, 1]
    assert kv.allocate_slots("b", 10, hit)
    s = _check(kv)
    assert s["blocks"] == "ssuu......" and s["refs"] == {0: 2, 1: 2}
    assert s["tables"] == {"a": [0, 1, 2], "b": [0, 1, 3]}
    assert [n[2] for n in s["prefix"]] == [1, 1]  # one hit on each block of the chain

    kv.free("a")
    kv.fork("b", "c", 10)
    s = _check(kv)
    assert s["blocks"] == "ss.s......" and s["refs"] == {0: 2, 1: 2, 3: 2}

    assert kv.swap_out("c") == [(0, 0), (1, 1), (3, 2)]
    s = _check(kv)
    assert s["blocks"] == "hh.u......" and s["host"] == "www."
    assert s["tables"] == {"b": [0, 1, 3]} and s["host_tables"] == {"c": [0, 1, 2]}

    kv.free("b")
    kv.free("c")
    s = _check(kv)
    assert s["blocks"] == "cc........" and s["host"] == "...." and s["tables"] == {}
    assert [n[:3] for n in s["prefix"]] == [[0, ROOT, 1], [1, 0, 1]]

    # the next allocation evicts the cached blocks: their hashes and hit counts go
    assert kv.allocate_slots("d", 40)
    s = _check(kv)
    assert s["blocks"] == "u" * 10 and s["prefix"] == []
    assert all(b.num_hits == 0 for b in kv.pool.blocks)


def test_evicting_a_chain_tail_keeps_its_head_and_a_lost_head_orphans_the_rest() -> None:
    kv = KVCacheManager(6, 4, True)
    assert kv.allocate_slots("a", 9)
    kv.cache_blocks("a", TOKENS[:9], 9)
    kv.free("a")  # frees 2, 1, 0 in that order: block 2 (unhashed), then the chain deepest first
    assert kv.pool.free_queue.ids() == [3, 4, 5, 2, 1, 0]
    assert kv.allocate_slots("b", 4 * 5)  # takes 3 4 5 2 1: evicts block 1 (the tail of the chain)
    s = _check(kv)
    assert [n[:2] for n in s["prefix"]] == [[0, ROOT]]
    kv.free("b")
    kv.check_integrity()
    # a chain whose head is evicted while a later block stays cached: held elsewhere meanwhile
    kv = KVCacheManager(4, 4, True)
    assert kv.allocate_slots("a", 8)
    kv.cache_blocks("a", TOKENS[:8], 8)
    kv.free("a")
    kv.pool.touch([kv.pool.blocks[1]])
    assert kv.allocate_slots("x", 12)  # blocks 2 3 0: evicts the chain's head
    kv.pool.free_blocks([kv.pool.blocks[1]])
    s = _check(kv)
    assert [n[:2] for n in s["prefix"]] == [[1, ORPHAN]] and s["blocks"] == "uc" + "uu"


def test_compaction_moves_hit_counts_with_the_hash() -> None:
    kv = KVCacheManager(8, 4, True)
    assert kv.allocate_slots("gap", 8)
    assert kv.allocate_slots("a", 9)  # blocks 2 3 4
    kv.cache_blocks("a", TOKENS[:9], 9)
    assert kv.allocate_slots("b", 10, kv.find_prefix(TOKENS))
    kv.free("gap")
    assert [b.num_hits for b in kv.pool.blocks[2:4]] == [1, 1]
    moves = kv.compact()
    assert moves  # the live blocks moved down
    s = _check(kv)
    hits = {n[0]: n[2] for n in s["prefix"]}
    assert sorted(hits.values()) == [1, 1] and set(hits) == set(kv.block_table("a")[:2])
