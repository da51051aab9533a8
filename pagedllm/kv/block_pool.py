"""The block pool: KV blocks, reference counts, the LRU free queue and the prefix-cache index.

Every block is in exactly one of two states::

    referenced   ref_cnt > 0   held by >= 1 block table; never in the free queue
    free         ref_cnt == 0  in the free queue; if it still carries a block_hash it is
                               "cached, evictable": a prefix hit can revive it (unlink from
                               the middle of the queue), an allocation can evict it (pop from
                               the head, hash dropped from the index)

    free queue:  head ─▶ [b7] ⇄ [b2] ⇄ [b9] ◀─ tail
                 allocate pops here   freed blocks are appended here  → least recently freed
                                                                         is evicted first (LRU)

The queue is intrusive (links live on the blocks) so that reviving a cached block from the
middle of the queue is O(1); ``collections.deque.remove`` would be O(n) on the hot path.
The pool knows nothing about requests; ``KVCacheManager`` owns the per-request tables.
Changes of the hash index are published on ``events`` (kv/events.py: stored, removed, cleared).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from pagedllm.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Compacted,
    Grown,
    KVEventBus,
    Shrunk,
    hash_hex,
)

__all__ = ["BlockHash", "BlockPool", "FreeBlockQueue", "KVBlock", "hash_hex"]


class BlockHash(NamedTuple):
    """Identity of one full, computed block of tokens in a prefix chain.

    ``value`` is the index key; ``parent``, ``token_ids`` and ``extra_keys`` are kept so that a
    hit is verified against the stored content and a colliding ``value`` never yields a wrong hit.
    """

    value: int
    parent: int | None  # value of the previous block's hash; None for the first block
    token_ids: tuple[int, ...]
    extra_keys: tuple | None


class KVBlock:
    """One block of ``block_size`` KV slots; ``prev_free``/``next_free`` link the free queue."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "num_hits", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.num_hits = 0  # prefix hits on the cached content this block holds (0 if unhashed)
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        h = None if self.block_hash is None else self.block_hash.token_ids
        return f"KVBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash_tokens={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks, threaded through ``KVBlock.prev_free/next_free``.

    ``popleft``, ``append`` and ``remove`` are O(1). A block is in the queue iff it is the head
    or has a ``prev_free`` link; the manager guarantees that iff ``ref_cnt == 0``.
    """

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self.head: KVBlock | None = None
        self.tail: KVBlock | None = None
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free

    def contains(self, block: KVBlock) -> bool:
        return block.prev_free is not None or self.head is block

    def appendleft(self, block: KVBlock) -> None:
        """Queue a block to be handed out first (fresh blocks of a grown pool)."""
        assert block.prev_free is None and block.next_free is None and self.head is not block
        if self.head is None:
            self.tail = block
        else:
            self.head.prev_free = block
            block.next_free = self.head
        self.head = block
        self.num_free += 1

    def popleft(self) -> KVBlock:
        block = self.head
        if block is None:
            raise IndexError("pop from an empty free block queue")
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        assert block.prev_free is None and block.next_free is None and self.head is not block
        if self.tail is None:
            self.head = block
        else:
            self.tail.next_free = block
            block.prev_free = self.tail
        self.tail = block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None:
            assert self.head is block, f"block {block.block_id} is not in the free queue"
            self.head = nxt
        else:
            prev.next_free = nxt
        if nxt is None:
            self.tail = prev
        else:
            nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def ids(self) -> list[int]:
        """Block ids from head (evicted/allocated next) to tail. O(n): tests and debugging."""
        out, block = [], self.head
        while block is not None:
            out.append(block.block_id)
            block = block.next_free
        return out


class BlockPool:
    """Owns the blocks, their ref counts, the free queue and the hash index; and the pool's size:
    ``grow`` / ``shrink`` change it, ``compact`` remaps live blocks to the lowest ids.

    Initially every block is free, queued in id order, so a fresh pool hands out 0, 1, 2, ...
    """

    def __init__(self, num_blocks: int, events: KVEventBus | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVBlock] = {}  # BlockHash.value -> the block that holds it
        # kept as counts change (the per-step stats read them; check_integrity recounts them)
        self.num_cached_free_blocks = 0  # free blocks still holding a cached hash
        self.num_shared_blocks = 0  # blocks with more than one reference
        self.events = KVEventBus() if events is None else events  # index changes, published

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt == 0, including cached-evictable ones."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the hash index (referenced or cached-free)."""
        return len(self.cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks with ref_cnt > 0."""
        return 1.0 - len(self.free_queue) / len(self.blocks)

    # -- allocation ---------------------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Pop ``n`` blocks from the head of the free queue (LRU), evicting cached ones."""
        if n > len(self.free_queue):
            raise ValueError(f"need {n} free KV blocks but only {len(self.free_queue)} are free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)  # a free block: its cached hash goes
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock], prefix_hit: bool = False) -> None:
        """Take one more reference on each block, reviving cached-evictable ones; a
        ``prefix_hit`` also counts a hit on each (the inspector's hit counts)."""
        for block in blocks:
            block.num_hits += prefix_hit
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                self.num_cached_free_blocks -= block.block_hash is not None
            elif block.ref_cnt == 1:
                self.num_shared_blocks += 1
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block, in the given order; a block whose count reaches 0
        goes to the tail of the free queue (so earlier blocks in ``blocks`` are evicted first)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)
                self.num_cached_free_blocks += block.block_hash is not None
            elif block.ref_cnt == 1:
                self.num_shared_blocks -= 1

    # -- prefix-cache index -------------------------------------------------------------------
    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        """The cached block with exactly this identity (value AND stored content), or None."""
        block = self.cached.get(block_hash.value)
        if block is None or block.block_hash != block_hash:
            return None  # miss, or a hash collision with different content
        return block

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Register ``block`` under ``block_hash``. If that value is already indexed (identical
        content held by another block, or a collision) the existing entry is kept: returns False."""
        assert block.ref_cnt > 0, f"only a referenced, computed block can be cached ({block})"
        if block.block_hash is not None or block_hash.value in self.cached:
            return False
        block.block_hash = block_hash
        block.num_hits = 0
        self.cached[block_hash.value] = block
        if self.events.active:
            parent = block_hash.parent
            self.events.publish(BlockStored(
                [hash_hex(block_hash.value)], None if parent is None else hash_hex(parent),
                list(block_hash.token_ids), len(block_hash.token_ids), None, [block.block_id]))
        return True

    def _evict(self, block: KVBlock) -> None:
        """Drop the cached hash of a free block."""
        if block.block_hash is not None:
            if self.events.active:
                self.events.publish(BlockRemoved([hash_hex(block.block_hash.value)],
                                                 [block.block_id]))
            del self.cached[block.block_hash.value]
            block.block_hash = None
            block.num_hits = 0
            self.num_cached_free_blocks -= 1

    def reset_prefix_cache(self, num_unhashed_held: int = 0) -> bool:
        """Forget every cached hash. Refused (False) while any block is referenced, but for
        ``num_unhashed_held`` blocks the caller holds outside any table (LoRA adapters' pages)."""
        if len(self.free_queue) + num_unhashed_held != self.num_blocks:
            return False
        for block in self.cached.values():
            block.block_hash = None
            block.num_hits = 0
        self.cached.clear()
        self.num_cached_free_blocks = 0
        if self.events.active:
            self.events.publish(AllBlocksCleared())
        return True

    # -- size and layout ----------------------------------------------------------------------
    def grow(self, n: int) -> None:
        """Add ``n`` fresh blocks (ids num_blocks .. num_blocks + n - 1), queued at the head so
        they are handed out before any cached block is evicted."""
        new = [KVBlock(i) for i in range(len(self.blocks), len(self.blocks) + n)]
        self.blocks.extend(new)
        for b in reversed(new):
            self.free_queue.appendleft(b)
        if self.events.ops:
            self.events.publish(Grown(n))

    def shrink(self, n: int) -> bool:
        """Drop blocks ``n`` .. end if all are free (``compact`` first); False (no change)
        otherwise. Cached hashes of dropped blocks are evicted."""
        tail = self.blocks[n:]
        ok = n >= 1 and all(b.ref_cnt == 0 for b in tail)
        if ok:
            for b in tail:
                self.free_queue.remove(b)
                self._evict(b)
            del self.blocks[n:]
        if self.events.ops:
            self.events.publish(Shrunk(n, ok))
        return ok

    def fragmentation(self) -> int:
        """Referenced blocks at ids >= num_used_blocks (what ``compact`` would move)."""
        return sum(1 for b in self.blocks[self.num_used_blocks:] if b.ref_cnt > 0)

    def compact(self) -> dict[int, KVBlock]:
        """Move referenced blocks to the lowest ids::

            before   ids  0 1 2 3 4 5 6 7     L = referenced, c = cached-free, . = free
                          L . L c . L . L
            compact  moves (5 -> 1), (7 -> 3)  ref counts and cached hashes move along; a
                          L L L L . . . .     cached-free destination loses its hash (evicted)

        Afterwards every block at or above ``num_used_blocks`` is free (``shrink`` can drop the
        tail). Returns {old block id: the block now holding its content}; the holders of the old
        ids (block tables) must follow the remap, and the KV tensors copy src -> dst.
        """
        k = self.num_used_blocks
        holes = [b for b in self.blocks[:k] if b.ref_cnt == 0]
        movers = [b for b in self.blocks[k:] if b.ref_cnt > 0]
        assert len(holes) == len(movers)
        remap: dict[int, KVBlock] = {}
        for src, dst in zip(movers, holes):
            self.free_queue.remove(dst)
            self._evict(dst)
            dst.ref_cnt, src.ref_cnt = src.ref_cnt, 0
            if src.block_hash is not None:
                dst.block_hash, src.block_hash = src.block_hash, None
                dst.num_hits, src.num_hits = src.num_hits, 0
                self.cached[dst.block_hash.value] = dst
            self.free_queue.append(src)
            remap[src.block_id] = dst
        if self.events.ops:
            self.events.publish(Compacted([[s, d.block_id] for s, d in remap.items()]))
        return remap

    # -- invariants ---------------------------------------------------------------------------
    def check_integrity(self, expected_refs: dict[int, int] | None = None) -> None:
        """Raise AssertionError if any pool invariant is violated.

        ``expected_refs`` maps block id -> number of holders; absent ids are expected to be 0.
        """
        queued: list[int] = []
        prev: KVBlock | None = None
        block = self.free_queue.head
        while block is not None:
            assert len(queued) < self.num_blocks, "free queue has a cycle"
            assert block.prev_free is prev, f"broken prev link at block {block.block_id}"
            queued.append(block.block_id)
            prev, block = block, block.next_free
        assert self.free_queue.tail is prev, "free queue tail is not its last block"
        assert len(queued) == len(self.free_queue), (
            f"free queue has {len(queued)} blocks but counts {len(self.free_queue)}")
        in_queue = set(queued)
        assert len(in_queue) == len(queued), f"a block is queued twice: {queued}"
        for b in self.blocks:
            assert b.ref_cnt >= 0, f"negative ref_cnt on {b}"
            if b.ref_cnt > 0:
                assert b.block_id not in in_queue, f"referenced block in the free queue: {b}"
            else:
                assert b.block_id in in_queue, f"free block missing from the free queue: {b}"
            if b.block_hash is not None:
                assert self.cached.get(b.block_hash.value) is b, f"hashed block not indexed: {b}"
            else:
                assert b.num_hits == 0, f"an unhashed block counts {b.num_hits} prefix hits: {b}"
            if expected_refs is not None:
                want = expected_refs.get(b.block_id, 0)
                assert b.ref_cnt == want, f"block {b.block_id}: ref_cnt {b.ref_cnt} != {want}"
        for value, b in self.cached.items():
            assert b.block_hash is not None and b.block_hash.value == value, (
                f"index entry {value} -> {b} does not match the block's hash")
        cached_free = sum(1 for b in self.blocks if b.ref_cnt == 0 and b.block_hash is not None)
        assert self.num_cached_free_blocks == cached_free, (
            f"num_cached_free_blocks={self.num_cached_free_blocks}, counted {cached_free}")
        shared = sum(1 for b in self.blocks if b.ref_cnt > 1)
        assert self.num_shared_blocks == shared, (
            f"num_shared_blocks={self.num_shared_blocks}, counted {shared}")
        if expected_refs is not None:
            unknown = set(expected_refs) - set(range(self.num_blocks))
            assert not unknown, f"expected refs for unknown block ids {sorted(unknown)}"
