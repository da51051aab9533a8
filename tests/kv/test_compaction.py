"""Compaction and elastic pool size: exact moves, plus a property test that compaction keeps
every request's content (shadow of the physical blocks), check_integrity, and returns every block."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.kv.manager import KVCacheManager


def test_compact_moves_live_blocks_to_the_lowest_ids() -> None:
    m = KVCacheManager(8, 4, enable_prefix_caching=True)
    for rid in "abcd":
        assert m.allocate_slots(rid, 8)  # a: 0 1, b: 2 3, c: 4 5, d: 6 7
    m.cache_blocks("d", list(range(8)), 8)
    m.free("a")
    m.free("c")
    assert m.fragmentation() == 2
    moves = m.compact()
    assert moves == [(6, 0), (7, 1)]
    assert m.block_table("b") == [2, 3] and m.block_table("d") == [0, 1]
    assert m.find_prefix(list(range(8)) + [9]).blocks == [0, 1]  # the hash index followed
    m.check_integrity()
    assert m.shrink(4) and m.num_blocks == 4 and m.num_free_blocks == 0
    m.grow(3)
    assert m.num_blocks == 7 and m.allocate_slots("e", 4) and m.block_table("e") == [4]
    m.check_integrity()


@settings(max_examples=120, deadline=None)
@given(data=st.data(), bs=st.sampled_from([1, 2, 4]), num_blocks=st.integers(4, 16),
       caching=st.booleans())
def test_compaction_keeps_content_and_integrity(data: st.DataObject, bs: int, num_blocks: int,
                                                caching: bool) -> None:
    m = KVCacheManager(num_blocks, bs, enable_prefix_caching=caching)
    tokens: dict[str, list[int]] = {}
    shadow: dict[int, dict[int, int]] = {}
    for step in range(data.draw(st.integers(1, 20))):
        op = data.draw(st.sampled_from(["new", "fork", "free", "compact", "grow", "shrink"]))
        live = sorted(tokens)
        if op == "new" or (op in ("fork", "free") and not live):
            rid = f"r{step}"
            toks = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=10))
            if m.allocate_slots(rid, len(toks)):
                tokens[rid] = toks
                for src, dst in m.take_block_copies():
                    shadow[dst] = dict(shadow.get(src, {}))
                for p, t in enumerate(toks):
                    shadow.setdefault(m.block_table(rid)[p // bs], {})[p % bs] = t
                m.cache_blocks(rid, toks, len(toks))
        elif op == "fork":
            parent = data.draw(st.sampled_from(live))
            m.fork(parent, f"r{step}", len(tokens[parent]))
            tokens[f"r{step}"] = list(tokens[parent])
        elif op == "free":
            rid = data.draw(st.sampled_from(live))
            m.free(rid)
            del tokens[rid]
        elif op == "grow":
            m.grow(data.draw(st.integers(1, 4)))
        else:  # compact, then maybe shrink (legal only down to the used blocks)
            moves = m.compact()
            shadow = {**shadow, **{dst: dict(shadow.get(src, {})) for src, dst in moves}}
            used = m.num_used_blocks
            assert all(b.ref_cnt == 0 for b in m.pool.blocks[used:])
            if op == "shrink":
                n = data.draw(st.integers(1, m.num_blocks))
                assert m.shrink(n) == (n >= used)
        m.check_integrity()
        assert m.num_blocks == len(m.pool.blocks)
        for rid, toks in tokens.items():
            table = m.block_table(rid)
            assert [shadow[table[p // bs]][p % bs] for p in range(len(toks))] == toks
    for rid in tokens:
        m.free(rid)
    m.check_integrity()
    assert m.num_free_blocks == m.num_blocks
