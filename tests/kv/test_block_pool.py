"""BlockPool: exact free-queue order, ref counts, hash index, eviction and integrity checks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.kv.block_pool import BlockHash, BlockPool, FreeBlockQueue, KVBlock


def bh(value: int, tokens: tuple[int, ...] = (1, 2, 3, 4), parent: int | None = None) -> BlockHash:
    return BlockHash(value, parent, tokens, None)


def ids(blocks: list[KVBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def test_fresh_pool_hands_out_blocks_in_id_order() -> None:
    pool = BlockPool(10)
    assert pool.free_queue.ids() == list(range(10))
    assert pool.num_free_blocks == 10 and pool.usage == 0.0
    got = pool.get_new_blocks(3)
    assert ids(got) == [0, 1, 2]
    assert [b.ref_cnt for b in got] == [1, 1, 1]
    assert pool.free_queue.ids() == list(range(3, 10))
    assert pool.num_free_blocks == 7 and pool.usage == pytest.approx(0.3)
    pool.check_integrity({0: 1, 1: 1, 2: 1})


def test_free_appends_to_tail_in_given_order() -> None:
    pool = BlockPool(5)
    a = pool.get_new_blocks(3)
    pool.free_blocks([a[2], a[0], a[1]])
    assert pool.free_queue.ids() == [3, 4, 2, 0, 1]
    assert ids(pool.get_new_blocks(4)) == [3, 4, 2, 0]
    pool.check_integrity({1: 0, 3: 1, 4: 1, 2: 1, 0: 1})


def test_shared_block_freed_only_when_last_ref_dropped() -> None:
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 1 and pool.num_free_blocks == 3
    pool.free_blocks([b])
    assert b.ref_cnt == 0 and pool.free_queue.ids() == [1, 2, 3, 0]
    pool.check_integrity({})


def test_get_new_blocks_too_many_raises_and_changes_nothing() -> None:
    pool = BlockPool(3)
    pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="need 2 free KV blocks but only 1"):
        pool.get_new_blocks(2)
    assert pool.free_queue.ids() == [2]
    pool.check_integrity({0: 1, 1: 1})


def test_cached_block_revived_from_middle_of_queue() -> None:
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(5)
    assert pool.cache_block(blocks[2], bh(42))
    pool.free_blocks(blocks)
    assert pool.free_queue.ids() == [0, 1, 2, 3, 4]
    hit = pool.get_cached_block(bh(42))
    assert hit is blocks[2]
    pool.touch([hit])
    assert pool.free_queue.ids() == [0, 1, 3, 4]
    assert hit.ref_cnt == 1 and hit.block_hash == bh(42)
    pool.check_integrity({2: 1})


def test_popping_a_cached_block_evicts_its_hash() -> None:
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, bh(7))
    pool.free_blocks([a, b])
    assert pool.cached == {7: a}
    (got,) = pool.get_new_blocks(1)
    assert got is a and a.block_hash is None and pool.cached == {}
    assert pool.get_cached_block(bh(7)) is None
    pool.check_integrity({0: 1})


def test_cache_block_keeps_existing_entry() -> None:
    pool = BlockPool(3)
    a, b, _ = pool.get_new_blocks(3)
    assert pool.cache_block(a, bh(1))
    assert not pool.cache_block(b, bh(1))  # identical content elsewhere: index keeps a
    assert pool.cached == {1: a} and b.block_hash is None
    assert not pool.cache_block(a, bh(2))  # already cached under its own hash
    pool.check_integrity({0: 1, 1: 1, 2: 1})


def test_get_cached_block_verifies_stored_content() -> None:
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, bh(5, tokens=(1, 2, 3, 4)))
    assert pool.get_cached_block(bh(5, tokens=(1, 2, 3, 4))) is a
    assert pool.get_cached_block(bh(5, tokens=(9, 9, 9, 9))) is None  # same value, other tokens
    assert pool.get_cached_block(bh(5, parent=3)) is None  # same value, other parent
    assert pool.get_cached_block(BlockHash(5, None, (1, 2, 3, 4), ("lora",))) is None


def test_reset_prefix_cache() -> None:
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    pool.cache_block(blocks[0], bh(1))
    assert not pool.reset_prefix_cache()  # a block is referenced
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert pool.cached == {} and all(b.block_hash is None for b in pool.blocks)
    pool.check_integrity({})


def test_free_queue_remove_head_middle_tail() -> None:
    blocks = [KVBlock(i) for i in range(4)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[1])
    assert q.ids() == [0, 2, 3] and len(q) == 3
    q.remove(blocks[3])
    q.remove(blocks[0])
    assert q.ids() == [2] and q.head is q.tail is blocks[2]
    assert q.popleft() is blocks[2] and q.head is None and q.tail is None and len(q) == 0
    with pytest.raises(IndexError):
        q.popleft()
    q.append(blocks[3])
    assert q.ids() == [3] and q.contains(blocks[3]) and not q.contains(blocks[0])


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda p: setattr(p.blocks[0], "ref_cnt", 1), "referenced block in the free queue"),
        (lambda p: setattr(p.blocks[9], "ref_cnt", -1), "negative ref_cnt"),
        (lambda p: setattr(p.free_queue, "num_free", 11), "counts 11"),
        (lambda p: setattr(p.blocks[3], "prev_free", p.blocks[0]), "broken prev link"),
        (lambda p: setattr(p.blocks[5], "block_hash", bh(3)), "hashed block not indexed"),
        (lambda p: p.cached.__setitem__(8, p.blocks[1]), "does not match"),
    ],
)
def test_check_integrity_catches_corruption(corrupt, message: str) -> None:
    pool = BlockPool(10)
    pool.check_integrity()
    corrupt(pool)
    with pytest.raises(AssertionError, match=message):
        pool.check_integrity()


def test_check_integrity_catches_free_block_missing_from_queue() -> None:
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    a.ref_cnt = 0  # "freed" without going back to the queue
    with pytest.raises(AssertionError, match="free block missing from the free queue"):
        pool.check_integrity()


def test_check_integrity_compares_expected_refs() -> None:
    pool = BlockPool(3)
    pool.get_new_blocks(2)
    pool.check_integrity({0: 1, 1: 1})
    with pytest.raises(AssertionError, match="block 1: ref_cnt 1 != 2"):
        pool.check_integrity({0: 1, 1: 2})
    with pytest.raises(AssertionError, match="block 0: ref_cnt 1 != 0"):
        pool.check_integrity({1: 1})
    with pytest.raises(AssertionError, match="unknown block ids"):
        pool.check_integrity({0: 1, 1: 1, 7: 0})


def test_double_free_is_caught() -> None:
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([a])


def test_bad_num_blocks() -> None:
    with pytest.raises(ValueError, match="num_blocks must be positive"):
        BlockPool(0)


def test_importing_kv_does_not_import_torch() -> None:
    code = ("import sys, pagedllm.kv, pagedllm.kv.plan, pagedllm.sched; "
            "assert 'torch' not in sys.modules, 'kv imported torch'")
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=root, timeout=60)
    assert res.returncode == 0, res.stderr
