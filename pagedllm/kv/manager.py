"""Per-request block tables and prefix caching on top of ``BlockPool``.

A request's block table maps its token positions to KV slots::

    token t  ──▶  table[t // block_size] * block_size + t % block_size   (the slot)

    tokens     [ a b c d | e f g h | i j . . ]      block_size = 4
    table      [    7    |    2    |    5    ]      block 5 is partially filled: never shared
    hashes     [   h0    |   h1    ]                h1 = H(h0, (e,f,g,h), extra_keys)

Only full blocks whose tokens are all computed are hashed (once, kept on the request) and
registered in the pool's index. ``find_prefix`` walks a new prompt's hash chain through the index;
the hit blocks become the head of the new request's table, shared by reference count.

Hash choice: BLAKE2b (128-bit digest) over a pickle of ``(parent_value, token_ids, extra_keys)``.
Unlike the built-in ``hash`` of an int tuple (64-bit and easy to collide on purpose, since ints
hash to themselves), an accidental or crafted collision of the *parent* link is out of reach; the
stored ``(parent, token_ids, extra_keys)`` is still compared on every hit, so a collision of the
value itself never produces a wrong hit. Values are also stable across processes (no hash seed).
Cost: ~1 µs per full block, paid once per block.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from pagedllm.kv.block_pool import BlockHash, BlockPool, KVBlock, hash_hex
from pagedllm.kv.compaction import CompactionMixin
from pagedllm.kv.sharing import SharingMixin
from pagedllm.kv.swap import SwapMixin

if TYPE_CHECKING:
    from pagedllm.kv.trace import KVTracer


def hash_block_tokens(parent: int | None, token_ids: tuple[int, ...],
                      extra_keys: tuple | None) -> int:
    """The chained value of one full block (see the module docstring for the choice)."""
    data = pickle.dumps((parent, token_ids, extra_keys), protocol=5)
    return int.from_bytes(hashlib.blake2b(data, digest_size=16).digest(), "little")


def make_block_hash(parent: BlockHash | None, token_ids: Sequence[int],
                    extra_keys: tuple | None) -> BlockHash:
    parent_value = None if parent is None else parent.value
    tokens = tuple(token_ids)
    value = hash_block_tokens(parent_value, tokens, extra_keys)
    return BlockHash(value, parent_value, tokens, extra_keys)


class PrefixHit(NamedTuple):
    """Cached full blocks that cover the head of a prompt. Holds no references.

    ``hashes`` (filled by ``find_prefix``) lets ``allocate_slots`` detect a hit that went stale
    because one of its blocks was evicted in between.
    """

    blocks: list[int]
    num_tokens: int
    hashes: tuple[BlockHash, ...] = ()


@dataclass
class PrefixCacheStats:
    """Token-level prefix-cache counters: ``queries`` prompt tokens looked up, ``hits`` found."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def reset(self) -> None:
        self.queries = self.hits = 0


class KVCacheManager(SharingMixin, SwapMixin, CompactionMixin):
    """Block tables for requests (by id), backed by one ``BlockPool``.

    Calls never partially apply: ``allocate_slots`` either covers the requested tokens or returns
    False with the pool untouched, so the scheduler can preempt and retry.
    """

    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True, num_host_blocks: int = 0, *,
                 contiguous_urgent: bool = False) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # urgent allocations take consecutive block ids where possible (BlockPool._take_contiguous)
        self.contiguous_urgent = contiguous_urgent
        self.pool = BlockPool(num_blocks)
        self.stats = PrefixCacheStats()
        self._tables: dict[str, list[KVBlock]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}  # hashes of the table's leading full blocks
        self._cow: dict[str, int] = {}  # table index of a shared partial block, copied on write
        self._copies: list[tuple[int, int]] = []  # (src, dst) block copies not yet taken
        self._pins: list[str] = []  # pseudo-requests holding pinned (preheated) prefix blocks
        self._init_swap(num_host_blocks)
        self._max_blocks = num_blocks
        self.tracer: KVTracer | None = None  # allocation event trace (pagedllm.kv.trace.attach)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def has_request(self, request_id: str) -> bool:
        return request_id in self._tables

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block ids, in token order."""
        table = self._tables.get(request_id)
        if table is None:
            raise KeyError(f"no blocks allocated for request {request_id!r}")
        return [b.block_id for b in table]

    # -- prefix lookup ------------------------------------------------------------------------
    def find_prefix(self, token_ids: Sequence[int], extra_keys: tuple | None = None,
                    record_stats: bool = True) -> PrefixHit:
        """Longest chain of cached full blocks at the head of ``token_ids``, covering at most
        ``len(token_ids) - 1`` tokens (the last prompt token is always recomputed: its logits).
        Takes no references; counts ``stats`` unless ``record_stats`` is False (the scheduler
        looks up on every admission attempt and records once, with ``record_prefix_query``)."""
        if not self.enable_prefix_caching:
            return PrefixHit([], 0)
        bs = self.block_size
        blocks: list[int] = []
        hashes: list[BlockHash] = []
        parent: BlockHash | None = None
        for i in range(max(len(token_ids) - 1, 0) // bs):
            h = make_block_hash(parent, token_ids[i * bs:(i + 1) * bs], extra_keys)
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            blocks.append(block.block_id)
            hashes.append(h)
            parent = h
        hit = PrefixHit(blocks, len(blocks) * bs, tuple(hashes))
        if record_stats:
            self.record_prefix_query(len(token_ids), hit.num_tokens)
        return hit

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_prefix_caching:
            self.stats.queries += num_tokens
            self.stats.hits += num_hit_tokens

    # -- allocation ---------------------------------------------------------------------------
    def num_blocks_needed(self, request_id: str, num_total_tokens: int,
                          prefix: PrefixHit | None = None) -> int:
        """Free blocks ``allocate_slots(request_id, num_total_tokens, prefix)`` would consume
        (new blocks plus prefix blocks that are currently cached-evictable)."""
        table = self._tables.get(request_id)
        have = len(table) if table is not None else 0
        revive = 0
        if table is None and prefix is not None:
            have = len(prefix.blocks)
            revive = sum(1 for i in prefix.blocks if self.pool.blocks[i].ref_cnt == 0)
        cow = 1 if table is not None and self._needs_copy(request_id, table) else 0
        return max(0, -(-num_total_tokens // self.block_size) - have) + revive + cow

    def allocate_slots(self, request_id: str, num_total_tokens: int,
                       prefix: PrefixHit | None = None, *, urgent: bool = False) -> bool:
        """Make ``request_id``'s table cover ``num_total_tokens`` slots; False (and no change at
        all) if the pool lacks free blocks. ``prefix`` is only accepted on the first call.
        ``urgent`` (the scheduler's urgent class) with ``contiguous_urgent`` on extends the table
        with consecutive block ids where the pool allows; the number of blocks taken is the same."""
        table = self._tables.get(request_id)
        hit: list[KVBlock] = []
        hit_hashes: list[BlockHash] = []
        if prefix is not None and prefix.blocks:
            if table is not None:
                raise ValueError(f"request {request_id!r} already has blocks; a prefix hit "
                                 "can only seed a new request's table")
            hit, hit_hashes = self._validate_prefix(prefix, num_total_tokens)
        tracer = self.tracer
        if self.num_blocks_needed(request_id, num_total_tokens, prefix) > self.pool.num_free_blocks:
            if tracer is not None:
                tracer.emit("allocate", rid=request_id, num_tokens=num_total_tokens,
                            prefix=[b.block_id for b in hit], ok=False, new=[])
            return False
        if table is None:
            if tracer is not None and hit:
                tracer.emit("prefix_hit", rid=request_id, blocks=[b.block_id for b in hit],
                            hashes=[hash_hex(h.value) for h in hit_hashes])
            self.pool.touch(hit)  # before get_new_blocks, so our own prefix is not evicted
            table = self._tables[request_id] = list(hit)
            self._hashes[request_id] = hit_hashes
        self._copy_on_write(request_id, table)
        n_new = -(-num_total_tokens // self.block_size) - len(table)
        contiguous = urgent and self.contiguous_urgent
        new = (self.pool.get_new_blocks(n_new, contiguous=contiguous,
                                        after=table[-1] if table else None)
               if n_new > 0 else [])
        table.extend(new)
        if tracer is not None:
            tracer.emit("allocate", rid=request_id, num_tokens=num_total_tokens,
                        prefix=[b.block_id for b in hit], ok=True, new=[b.block_id for b in new],
                        **({"urgent": True} if contiguous else {}))
        return True

    def _validate_prefix(self, prefix: PrefixHit,
                         num_total_tokens: int) -> tuple[list[KVBlock], list[BlockHash]]:
        if not self.enable_prefix_caching:
            raise ValueError("prefix hit passed while prefix caching is disabled")
        if prefix.num_tokens != len(prefix.blocks) * self.block_size:
            raise ValueError(f"prefix covers {len(prefix.blocks)} blocks but claims "
                             f"{prefix.num_tokens} tokens")
        if num_total_tokens < prefix.num_tokens:
            raise ValueError(f"num_total_tokens={num_total_tokens} is below the prefix hit's "
                             f"{prefix.num_tokens} tokens")
        blocks = [self.pool.blocks[i] for i in prefix.blocks]
        hashes: list[BlockHash] = []
        for i, b in enumerate(blocks):
            h = b.block_hash
            if h is None or (prefix.hashes and h != prefix.hashes[i]):
                raise ValueError(f"stale prefix hit: block {b.block_id} was evicted after "
                                 "find_prefix; call find_prefix again right before allocate_slots")
            hashes.append(h)
        return blocks, hashes

    def cache_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int,
                     extra_keys: tuple | None = None) -> None:
        """Hash and register the request's blocks that became full and fully computed.

        Each block is hashed once (the chain is kept per request). If an identical block is
        already indexed the index keeps it; the request keeps its own copy. Unknown request ids
        (e.g. aborted between schedule and update) are ignored.
        """
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(request_id)
        if table is None:
            return
        hashes = self._hashes[request_id]
        bs = self.block_size
        num_full = min(num_computed_tokens, len(token_ids), len(table) * bs) // bs
        start = len(hashes)
        for i in range(start, num_full):
            h = make_block_hash(hashes[-1] if hashes else None, token_ids[i * bs:(i + 1) * bs],
                                extra_keys)
            self.pool.cache_block(table[i], h)
            hashes.append(h)
        if self.tracer is not None and num_full > start:
            self.tracer.emit("cache", rid=request_id, start=start,
                             tokens=list(token_ids[start * bs:num_full * bs]),
                             blocks=[b.block_id for b in table[start:num_full]],
                             hashes=[hash_hex(h.value) for h in hashes[start:]],
                             **({} if extra_keys is None else {"extra_keys": list(extra_keys)}))

    def free(self, request_id: str) -> None:
        """Release the request's blocks, last block first: among its cached blocks the deepest
        is evicted first. Unknown ids are a no-op."""
        if self.tracer is not None and (request_id in self._tables or self.is_swapped(request_id)):
            self.tracer.emit("free", rid=request_id,
                             blocks=[b.block_id for b in self._tables.get(request_id, ())],
                             swapped=self.is_swapped(request_id))
        self._drop_swapped(request_id)
        table = self._tables.pop(request_id, None)
        self._hashes.pop(request_id, None)
        self._cow.pop(request_id, None)
        if table is not None:
            if self._copies:  # a copy into a block that is freed before the step runs is moot
                gone = {b.block_id for b in table if b.ref_cnt == 1}
                self._copies = [c for c in self._copies if c[1] not in gone]
            self.pool.free_blocks(reversed(table))

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; refused (False) while any request holds blocks."""
        ok = not any(self._tables.values()) and self.pool.reset_prefix_cache()
        if self.tracer is not None:
            self.tracer.emit("reset_prefix_cache", ok=ok)
        return ok

    def check_integrity(self) -> None:
        """Pool invariants, plus: each block's ref_cnt equals the number of tables holding it,
        no table holds a block twice, and per-request hashes never outrun the table."""
        refs: dict[int, int] = {}
        for rid, table in self._tables.items():
            ids = [b.block_id for b in table]
            assert len(set(ids)) == len(ids), f"request {rid!r} holds a block twice: {ids}"
            for i in ids:
                refs[i] = refs.get(i, 0) + 1
            hashes = self._hashes[rid]
            assert len(hashes) <= len(table), f"request {rid!r}: more hashes than blocks"
            for b, h in zip(table[:len(hashes)], hashes, strict=True):
                assert b.block_hash is None or b.block_hash == h, (
                    f"request {rid!r}: block {b.block_id} is cached under another hash")
            for b in table[len(hashes):]:
                assert b.block_hash is None, f"request {rid!r}: unhashed position holds {b}"
        assert self._hashes.keys() == self._tables.keys() | self._swapped.keys(), (
            "hash lists and tables disagree")
        self._check_swap_integrity()
        self.pool.check_integrity(refs)
