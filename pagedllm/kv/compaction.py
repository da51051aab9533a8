"""Compaction (defragmentation) and an elastic pool size, on top of ``KVCacheManager``.

    before   ids  0 1 2 3 4 5 6 7     L = referenced, c = cached-free, . = free
                  L . L c . L . L
    compact  moves (5 -> 1), (7 -> 3)  live blocks fill the lowest free ids; tables, the hash
                  L L L L . . . .     index and per-request hashes follow; a cached-free block
                                       that is a destination loses its hash (it is evicted)

Afterwards every block at or above ``num_used`` is free, so ``shrink`` can drop the tail. The
moves are (src, dst) pairs for the runner's one batched copy; compaction runs between steps
(never with pending copy-on-write copies). ``grow`` appends fresh blocks, handed out before any
cached block is evicted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.kv.block_pool import BlockHash, BlockPool, KVBlock

if TYPE_CHECKING:
    from pagedllm.kv.trace import KVTracer


class CompactionMixin:
    """Mixed into ``KVCacheManager``."""

    pool: BlockPool
    num_blocks: int
    _tables: dict[str, list[KVBlock]]
    _hashes: dict[str, list[BlockHash]]
    _copies: list[tuple[int, int]]
    _max_blocks: int
    tracer: KVTracer | None

    @property
    def max_num_blocks(self) -> int:
        """The most blocks the pool may ever hold (above ``num_blocks`` for an elastic pool)."""
        return max(self._max_blocks, self.num_blocks)

    def set_max_num_blocks(self, n: int) -> None:
        self._max_blocks = n

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free_blocks

    def fragmentation(self) -> int:
        """Referenced blocks at ids >= num_used_blocks (what ``compact`` would move)."""
        k = self.num_used_blocks
        return sum(1 for b in self.pool.blocks[k:] if b.ref_cnt > 0)

    def compact(self) -> list[tuple[int, int]]:
        """Move referenced blocks to the lowest ids; returns the (src, dst) moves to apply."""
        assert not self._copies, "compact() between steps only (copy-on-write copies pending)"
        pool = self.pool
        k = self.num_used_blocks
        holes = [b for b in pool.blocks[:k] if b.ref_cnt == 0]
        movers = [b for b in pool.blocks[k:] if b.ref_cnt > 0]
        assert len(holes) == len(movers)
        remap: dict[int, KVBlock] = {}
        for src, dst in zip(movers, holes):
            pool.free_queue.remove(dst)
            pool._evict(dst)
            dst.ref_cnt, src.ref_cnt = src.ref_cnt, 0
            if src.block_hash is not None:
                dst.block_hash, src.block_hash = src.block_hash, None
                pool.cached[dst.block_hash.value] = dst
            pool.free_queue.append(src)
            remap[src.block_id] = dst
        if remap:
            for table in self._tables.values():
                for i, b in enumerate(table):
                    table[i] = remap.get(b.block_id, b)
        moves = [(s, d.block_id) for s, d in remap.items()]
        if self.tracer is not None:
            self.tracer.emit("compact", moves=[list(m) for m in moves])
        return moves

    def grow(self, n: int) -> None:
        """Add ``n`` fresh blocks (ids num_blocks .. num_blocks + n - 1)."""
        pool = self.pool
        new = [KVBlock(i) for i in range(pool.num_blocks, pool.num_blocks + n)]
        pool.blocks.extend(new)
        for b in reversed(new):
            pool.free_queue.appendleft(b)
        pool.num_blocks += n
        self.num_blocks = pool.num_blocks
        if self.tracer is not None:
            self.tracer.emit("grow", n=n)

    def shrink(self, n: int) -> bool:
        """Drop blocks ``n`` .. end if all are free (call ``compact`` first); False otherwise."""
        pool = self.pool
        tail = pool.blocks[n:]
        if n < 1 or any(b.ref_cnt > 0 for b in tail):
            if self.tracer is not None:
                self.tracer.emit("shrink", n=n, ok=False)
            return False
        for b in tail:
            pool.free_queue.remove(b)
            pool._evict(b)
        del pool.blocks[n:]
        pool.num_blocks = n
        self.num_blocks = n
        if self.tracer is not None:
            self.tracer.emit("shrink", n=n, ok=True)
        return True
