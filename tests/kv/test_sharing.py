"""Fork / copy-on-write: exact block ids and ref counts, plus a random-operation property test
with a shadow of the physical KV content (a write never lands in a block another request holds)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.kv.manager import KVCacheManager


def test_fork_shares_blocks_and_copies_the_partial_one_on_write() -> None:
    m = KVCacheManager(10, 4, enable_prefix_caching=True)
    assert m.allocate_slots("p", 10)  # blocks 0 1 2; fork point 10 = 2 full + 2 tokens
    m.cache_blocks("p", list(range(10)), 10)
    m.fork("p", "c", 10)
    assert m.block_table("c") == [0, 1, 2]
    assert [b.ref_cnt for b in m.pool.blocks[:3]] == [2, 2, 2]
    assert m.num_blocks_needed("c", 11) == 1  # the copy of block 2
    assert m.allocate_slots("c", 11)
    assert m.block_table("c") == [0, 1, 3] and m.take_block_copies() == [(2, 3)]
    assert m.num_blocks_needed("p", 11) == 0  # p is the last holder of block 2: writes in place
    assert m.allocate_slots("p", 11) and m.block_table("p") == [0, 1, 2]
    assert m.take_block_copies() == []
    m.check_integrity()
    m.free("p")
    m.free("c")
    m.check_integrity()
    assert m.num_free_blocks == 10


def test_fork_at_a_block_boundary_copies_nothing() -> None:
    m = KVCacheManager(6, 4, enable_prefix_caching=False)
    assert m.allocate_slots("p", 8)
    m.fork("p", "c", 8)
    assert m.allocate_slots("c", 9) and m.allocate_slots("p", 9)
    assert m.block_table("c") == [0, 1, 2] and m.block_table("p") == [0, 1, 3]
    assert m.take_block_copies() == []
    m.check_integrity()


def test_a_copy_into_a_block_freed_before_the_step_is_dropped() -> None:
    m = KVCacheManager(6, 4, enable_prefix_caching=False)
    assert m.allocate_slots("p", 6)
    m.fork("p", "c", 6)
    assert m.allocate_slots("c", 7)
    m.free("c")  # preempted in the same schedule()
    assert m.take_block_copies() == []
    m.free("p")
    m.check_integrity()
    assert m.num_free_blocks == 6


@settings(max_examples=150, deadline=None)
@given(data=st.data(), bs=st.sampled_from([1, 2, 4]), num_blocks=st.integers(4, 16),
       caching=st.booleans())
def test_random_forks_writes_and_frees(data: st.DataObject, bs: int, num_blocks: int,
                                       caching: bool) -> None:
    m = KVCacheManager(num_blocks, bs, enable_prefix_caching=caching)
    tokens: dict[str, list[int]] = {}
    shadow: dict[int, dict[int, int]] = {}  # block -> offset -> token written there
    ids = iter(range(10**6))

    def write(rid: str, start: int, end: int) -> None:
        table = m.block_table(rid)
        for src, dst in m.take_block_copies():
            shadow[dst] = dict(shadow.get(src, {}))
        for pos in range(start, end):
            b = table[pos // bs]
            assert m.pool.blocks[b].ref_cnt == 1, f"{rid} writes into shared block {b}"
            shadow.setdefault(b, {})[pos % bs] = tokens[rid][pos]
        m.cache_blocks(rid, tokens[rid], end)

    for _ in range(data.draw(st.integers(1, 25))):
        op = data.draw(st.sampled_from(["new", "fork", "grow", "free"]))
        live = sorted(tokens)
        if op == "new" or not live:
            rid = f"r{next(ids)}"
            toks = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=10))
            if m.allocate_slots(rid, len(toks)):
                tokens[rid] = toks
                write(rid, 0, len(toks))
        elif op == "fork":
            parent = data.draw(st.sampled_from(live))
            child = f"r{next(ids)}"
            m.fork(parent, child, len(tokens[parent]))
            tokens[child] = list(tokens[parent])
        elif op == "grow":
            rid = data.draw(st.sampled_from(live))
            extra = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=5))
            start = len(tokens[rid])
            if m.allocate_slots(rid, start + len(extra)):
                tokens[rid] += extra
                write(rid, start, len(tokens[rid]))
            else:
                assert m.take_block_copies() == []
        else:
            rid = data.draw(st.sampled_from(live))
            m.free(rid)
            del tokens[rid]
        m.check_integrity()
        for rid, toks in tokens.items():  # every request reads back exactly its own tokens
            table = m.block_table(rid)
            got = [shadow[table[p // bs]][p % bs] for p in range(len(toks))]
            assert got == toks, f"{rid} reads {got}, wrote {toks}"
    for rid in list(tokens):
        m.free(rid)
    m.check_integrity()
    assert m.num_free_blocks == num_blocks
