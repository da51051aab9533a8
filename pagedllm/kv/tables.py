"""Per-request block tables: the blocks each request holds and the hashes of its full blocks.

A request's block table maps its token positions to KV slots::

    token t  ──▶  table[t // block_size] * block_size + t % block_size   (the slot)

    tokens     [ a b c d | e f g h | i j . . ]      block_size = 4
    table      [    7    |    2    |    5    ]      block 5 is partially filled: never shared
    hashes     [   h0    |   h1    ]                h1 = H(h0, (e,f,g,h), extra_keys)

Sliding window (kv/window.py): blocks wholly behind every later query's window are freed as the
request advances; ``held`` then holds the blocks still held and ``skipped`` counts the positions
before them (token t: held block ``t // block_size - skipped``).

``KVCacheManager`` owns one ``RequestTables`` and is the only writer; this part answers the
queries about a request's table and checks the tables against the pool.
"""

from __future__ import annotations

import itertools

from pagedllm.kv.block_pool import BlockHash, KVBlock


class RequestTables:
    """Per request id: ``held`` (the device blocks, in token order; absent while swapped out),
    ``skipped`` (positions freed behind the window before them) and ``hashes`` (of the leading
    full, computed blocks by position; None: skipped by a windowed hit). ``skipped`` and
    ``hashes`` are kept while a request is swapped out."""

    def __init__(self) -> None:
        self.held: dict[str, list[KVBlock]] = {}
        self.skipped: dict[str, int] = {}
        self.hashes: dict[str, list[BlockHash | None]] = {}

    def table(self, request_id: str) -> list[KVBlock]:
        """The request's held blocks (the list itself); KeyError naming it if it holds none."""
        table = self.held.get(request_id)
        if table is None:
            raise KeyError(f"no blocks allocated for request {request_id!r}")
        return table

    def held_blocks(self, request_id: str) -> list[int]:
        """Ids of the blocks the request holds, in token order (no placeholders)."""
        return [b.block_id for b in self.table(request_id)]

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids by position (a copy): what the runner is given.

        A position freed behind the sliding window reads as the request's first held block: every
        entry names a block the request holds, so a backend that gathers such a position (it is
        always masked out) reads this request's own K/V, never a freed block being rewritten."""
        ids = self.held_blocks(request_id)
        return ids[:1] * skip + ids if (skip := self.skipped[request_id]) else ids

    def positions(self, request_id: str) -> list[int | None]:
        """The held block ids by table position, None where freed behind the window (how the
        KV op events name a table)."""
        return [None] * self.skipped[request_id] + self.held_blocks(request_id)

    def num_shared(self, request_id: str) -> int:
        """Leading held blocks that others hold too (ref count > 1): prefix hits and forks share
        a table's head, so the count stops at the first private block."""
        table = self.held.get(request_id, [])
        return next((i for i, b in enumerate(table) if b.ref_cnt < 2), len(table))

    def check(self, windowed: bool, swapped: set[str]) -> dict[int, int]:
        """Assert: no table holds a block twice, per-request hashes never outrun the table (an
        unhashed block is uncached), only a windowed manager skips positions (a held block always
        remains), a swapped request holds no device block. Returns block id -> holders."""
        refs: dict[int, int] = {}
        for rid, table in self.held.items():
            ids = [b.block_id for b in table]
            assert len(set(ids)) == len(ids), f"request {rid!r} holds a block twice: {ids}"
            for i in ids:
                refs[i] = refs.get(i, 0) + 1
            hashes, skip = self.hashes[rid], self.skipped[rid]
            assert not skip or (windowed and table), f"{rid!r} skips {skip}"
            assert len(hashes) <= skip + len(table), f"request {rid!r}: more hashes than blocks"
            for b, h in itertools.zip_longest(table, hashes[skip:]):
                assert b is not None and (b.block_hash is None or b.block_hash == h), (
                    f"request {rid!r}: block {b} is cached under another hash than {h}")
        assert not (swapped & self.held.keys()), "a request is on both tiers"
        assert self.hashes.keys() == self.held.keys() | swapped == self.skipped.keys(), (
            "hash lists, offsets and tables disagree")
        return refs
