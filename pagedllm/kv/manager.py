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

Sliding-window models (kv/window.py): blocks that fall wholly behind every later query's window
are freed as the request advances (``free_outside_window``). The table then starts at an offset:
``_tables`` holds the blocks still held and ``_skipped`` counts the freed positions before them,
so token t lives in held block ``t // block_size - skipped``. Freed blocks are never hashed
(a block is hashed when it fills, before it can leave the window), and a prefix hit needs only
the blocks inside the window of its first uncomputed token.

The manager holds its parts: the ``BlockPool`` (blocks, free queue, hash index, pool size), a
``CopyOnWrite`` (shared partial blocks and pending copies, kv/sharing.py), a ``HostTier``
(swap plans, kv/host_tier.py) and a ``SlidingWindow`` (kv/window.py). Tracing (kv/trace.py)
wraps its public calls from outside.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence

from pagedllm.kv.block_pool import BlockHash, BlockPool, KVBlock
from pagedllm.kv.host_tier import HostTier
from pagedllm.kv.prefix import PrefixCacheStats, PrefixHit
from pagedllm.kv.sharing import CopyOnWrite
from pagedllm.kv.window import SlidingWindow

__all__ = ["KVCacheManager", "PrefixCacheStats", "PrefixHit", "hash_block_tokens"]

PIN_PREFIX = "__pinned__/"


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


class KVCacheManager:
    """Block tables for requests (by id), backed by one ``BlockPool``.

    Calls never partially apply: ``allocate_slots`` either covers the requested tokens or returns
    False with the pool untouched, so the scheduler can preempt and retry.
    """

    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True, num_host_blocks: int = 0,
                 sliding_window: int | None = None) -> None:
        """``sliding_window``: every layer attends to its last this many positions, so blocks
        that leave the window are freed (None: every block is kept)."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.cow = CopyOnWrite()
        self.host = HostTier(num_host_blocks)
        self.window = None if sliding_window is None else SlidingWindow(sliding_window, block_size)
        self.stats = PrefixCacheStats()
        self._tables: dict[str, list[KVBlock]] = {}  # the blocks held, in token order
        # leading positions freed behind the window (the table's offset); kept while swapped out
        self._skipped: dict[str, int] = {}
        # hashes of the leading full blocks, by position (None: skipped by a windowed prefix
        # hit, unknown); swapped-out requests keep theirs
        self._hashes: dict[str, list[BlockHash | None]] = {}
        self._pins: list[str] = []  # pseudo-requests holding pinned (preheated) prefix blocks
        self.num_window_freed = 0  # blocks freed behind the sliding window, in all
        self._max_blocks = num_blocks
        self.tracer: object | None = None  # the KVTracer recording this manager (kv/trace.py)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_requests(self) -> int:
        """Requests holding device blocks or swapped out (pins included)."""
        return len(self._hashes)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._tables

    @property
    def sliding_window(self) -> int | None:
        return None if self.window is None else self.window.window

    def _held(self, request_id: str) -> list[KVBlock]:
        table = self._tables.get(request_id)
        if table is None:
            raise KeyError(f"no blocks allocated for request {request_id!r}")
        return table

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids by position (a copy): what the runner is given.

        A position freed behind the sliding window reads as the request's first held block: every
        entry names a block the request holds, so a backend that gathers such a position (it is
        always masked out) reads this request's own K/V, never a freed block being rewritten."""
        ids = [b.block_id for b in self._held(request_id)]
        k = self._skipped[request_id]
        return [ids[0]] * k + ids if k and ids else ids

    def num_blocks_of(self, request_id: str) -> int:
        """Device blocks the request holds (0 if none; placeholders not counted)."""
        table = self._tables.get(request_id)
        return 0 if table is None else len(table)

    def num_shared_blocks_of(self, request_id: str) -> int:
        """Leading held blocks of the request's table that others hold too (ref count > 1): prefix
        hits and forks share a table's head, so the count stops at the first private block."""
        n = 0
        for b in self._tables.get(request_id, ()):
            if b.ref_cnt < 2:
                break
            n += 1
        return n

    def held_blocks(self, request_id: str) -> list[int]:
        """Ids of the blocks the request holds, in token order (no placeholders)."""
        return [b.block_id for b in self._held(request_id)]

    def num_skipped_blocks(self, request_id: str) -> int:
        """Leading positions of the table whose blocks were freed behind the sliding window."""
        return self._skipped[request_id]

    def block_hashes(self, request_id: str) -> list[BlockHash | None]:
        """A copy of the hashes of the request's leading full, computed blocks, by position."""
        return list(self._hashes.get(request_id, ()))

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
        found: list[tuple[BlockHash, KVBlock | None]] = []
        parent: BlockHash | None = None
        for i in range(max(len(token_ids) - 1, 0) // bs):
            parent = make_block_hash(parent, token_ids[i * bs:(i + 1) * bs], extra_keys)
            found.append((parent, self.pool.get_cached_block(parent)))
            if found[-1][1] is None and self.window is None:
                break  # full attention: the chain must be cached from its first block
        if self.window is None:
            n, skip = sum(1 for _, b in found if b is not None), 0
        else:  # only the blocks inside the window of the first uncomputed token are needed
            n = self.window.longest_hit([b is not None for _, b in found])
            skip = self.window.first_needed_block(n * bs)
        held = found[skip:n]
        hit = PrefixHit([b.block_id for _, b in held if b is not None], n * bs,
                        tuple(h for h, _ in held), skip)
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
        have = len(table) + self._skipped[request_id] if table is not None else 0  # positions
        revive = 0
        if table is None and prefix is not None:
            have = prefix.num_skipped + len(prefix.blocks)
            revive = sum(1 for i in prefix.blocks if self.pool.blocks[i].ref_cnt == 0)
        cow = 1 if table is not None and self.cow.needs_copy(request_id, table) else 0
        return max(0, -(-num_total_tokens // self.block_size) - have) + revive + cow

    def allocate_slots(self, request_id: str, num_total_tokens: int,
                       prefix: PrefixHit | None = None) -> bool:
        """Make ``request_id``'s table cover ``num_total_tokens`` slots; False (and no change at
        all) if the pool lacks free blocks. ``prefix`` is only accepted on the first call."""
        table = self._tables.get(request_id)
        hit: list[KVBlock] = []
        hit_hashes: list[BlockHash | None] = []
        if prefix is not None and prefix.blocks:
            if table is not None:
                raise ValueError(f"request {request_id!r} already has blocks; a prefix hit "
                                 "can only seed a new request's table")
            hit, hit_hashes = self._validate_prefix(prefix, num_total_tokens)
        if self.num_blocks_needed(request_id, num_total_tokens, prefix) > self.pool.num_free_blocks:
            return False
        if table is None:
            self.pool.touch(hit)  # before get_new_blocks, so our own prefix is not evicted
            table = self._tables[request_id] = list(hit)
            skip = prefix.num_skipped if prefix is not None and hit else 0
            self._skipped[request_id] = skip
            unknown: list[BlockHash | None] = [None] * skip
            self._hashes[request_id] = unknown + hit_hashes
        self.cow.before_write(request_id, table, self.pool)
        n_new = -(-num_total_tokens // self.block_size) - len(table) - self._skipped[request_id]
        if n_new > 0:
            table.extend(self.pool.get_new_blocks(n_new))
        return True

    def _validate_prefix(self, prefix: PrefixHit,
                         num_total_tokens: int) -> tuple[list[KVBlock], list[BlockHash | None]]:
        if not self.enable_prefix_caching:
            raise ValueError("prefix hit passed while prefix caching is disabled")
        positions = prefix.num_skipped + len(prefix.blocks)
        if prefix.num_tokens != positions * self.block_size:
            raise ValueError(f"prefix covers {positions} blocks but claims "
                             f"{prefix.num_tokens} tokens")
        if prefix.num_skipped and (self.window is None or prefix.num_skipped
                                   > self.window.first_needed_block(prefix.num_tokens)):
            raise ValueError(f"prefix skips {prefix.num_skipped} blocks that the sliding window "
                             f"({self.sliding_window}) still needs")
        if num_total_tokens < prefix.num_tokens:
            raise ValueError(f"num_total_tokens={num_total_tokens} is below the prefix hit's "
                             f"{prefix.num_tokens} tokens")
        blocks = [self.pool.blocks[i] for i in prefix.blocks]
        hashes: list[BlockHash | None] = []
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
        bs, skip = self.block_size, self._skipped[request_id]
        num_full = min(num_computed_tokens, len(token_ids), (skip + len(table)) * bs) // bs
        start = len(hashes)
        if start and hashes[-1] is None:
            return  # the chain's parent is unknown (a replayed windowed hit): cannot extend it
        for i in range(start, num_full):
            h = make_block_hash(hashes[-1] if hashes else None, token_ids[i * bs:(i + 1) * bs],
                                extra_keys)
            if i >= skip:  # a block freed behind the window is never hashed into the index
                self.pool.cache_block(table[i - skip], h)
            hashes.append(h)

    def free_outside_window(self, request_id: str, num_computed_tokens: int) -> int:
        """Free the request's blocks that lie wholly before the sliding window of every token
        after its first ``num_computed_tokens`` (call once they are computed and hashed: after
        ``cache_blocks``). Returns how many blocks were freed; 0 without a window. The oldest
        goes to the free queue first (evicted first). Unknown ids are ignored."""
        table = self._tables.get(request_id)
        if self.window is None or table is None:
            return 0
        skip = self._skipped[request_id]
        n = min(self.window.first_needed_block(num_computed_tokens) - skip, len(table) - 1)
        if n <= 0:
            return 0
        gone = table[:n]
        del table[:n]
        self._skipped[request_id] = skip + n
        self.cow.shift(request_id, n)
        self.pool.free_blocks(gone)
        self.num_window_freed += n
        return n

    def free(self, request_id: str) -> None:
        """Release the request's blocks, last block first: among its cached blocks the deepest
        is evicted first. Unknown ids are a no-op."""
        table = self._tables.pop(request_id, None)
        self._hashes.pop(request_id, None)
        self._skipped.pop(request_id, None)
        self.host.drop(request_id)
        self.cow.forget(request_id, table)
        if table is not None:
            self.pool.free_blocks(reversed(table))

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; refused (False) while any request holds blocks."""
        return not any(self._tables.values()) and self.pool.reset_prefix_cache()

    # -- sharing: fork (copy-on-write, kv/sharing.py) and pinned prefixes --------------------------
    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> None:
        """Give ``child_id`` the parent's blocks covering its first ``num_tokens`` (computed)
        tokens, by reference. Takes no free block; a shared partial last block is copied on the
        next write of whichever sharer writes first."""
        if child_id in self._tables:
            raise ValueError(f"request {child_id!r} already has blocks")
        parent = self._tables.get(parent_id)
        if parent is None:
            raise KeyError(f"no blocks allocated for request {parent_id!r}")
        skip = self._skipped[parent_id]
        n_blocks = -(-num_tokens // self.block_size) - skip  # of the parent's held blocks
        if n_blocks > len(parent):
            raise ValueError(f"fork at {num_tokens} tokens but {parent_id!r} holds "
                             f"{skip + len(parent)} blocks")
        if n_blocks < 1:
            raise ValueError(f"fork at {num_tokens} tokens: {parent_id!r} freed those blocks "
                             "behind its sliding window")
        shared = parent[:n_blocks]
        self.pool.touch(shared)
        self._tables[child_id] = list(shared)
        self._skipped[child_id] = skip
        self._hashes[child_id] = self._hashes[parent_id][:num_tokens // self.block_size]
        if num_tokens % self.block_size:
            self.cow.mark(child_id, n_blocks - 1)
            self.cow.mark(parent_id, n_blocks - 1)

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) copies made by ``allocate_slots`` since the last call; the runner must
        apply them (in one batch) before writing into the dst blocks."""
        return self.cow.take()

    def pin(self, token_ids: Sequence[int]) -> int:
        """Warm-up: take one reference on the cached full blocks at the head of ``token_ids`` (as
        ``find_prefix`` finds them) under a pseudo-request, so they are never evicted; returns how
        many blocks were pinned. ``unpin_all`` releases them."""
        hit = self.find_prefix(token_ids, record_stats=False)
        if not hit.blocks:
            return 0
        pin_id = f"{PIN_PREFIX}{len(self._pins)}"
        assert self.allocate_slots(pin_id, hit.num_tokens, hit), "pinning takes no free block"
        self._pins.append(pin_id)
        return len(hit.blocks)

    @property
    def num_pinned_blocks(self) -> int:
        return len({b.block_id for p in self._pins for b in self._tables[p]})

    def unpin_all(self) -> None:
        for pin_id in self._pins:
            self.free(pin_id)
        self._pins.clear()

    # -- the host tier (swap plans, kv/host_tier.py; ``self.host`` answers queries) ---------------
    @property
    def num_host_blocks(self) -> int:
        return self.host.num_blocks

    @property
    def num_free_host_blocks(self) -> int:
        return self.host.num_free_blocks

    def is_swapped(self, request_id: str) -> bool:
        return self.host.holds(request_id)

    def swap_out(self, request_id: str) -> list[tuple[int, int]] | None:
        """Move the request's blocks to the host tier: (device, host) pairs to copy, or None
        (nothing changed) if the host tier lacks room. The request keeps its computed count, its
        prefix hashes and its sliding-window offset; its device blocks are freed (shared ones
        stay with their holders)."""
        table = self._tables.get(request_id)
        if table is None:
            raise KeyError(f"no blocks allocated for request {request_id!r}")
        if len(table) > self.host.num_free_blocks:
            return None
        pairs = self.host.swap_out(request_id, self.cow.sources(request_id, table))
        assert pairs is not None
        del self._tables[request_id]
        self.pool.free_blocks(reversed(table))
        return pairs

    def swap_in(self, request_id: str) -> list[tuple[int, int]] | None:
        """Bring a swapped request back into fresh device blocks: (host, device) pairs to copy, or
        None (nothing changed) if the device pool lacks free blocks. Its prefix hashes are
        re-registered where no other block holds them."""
        n = self.host.num_blocks_of(request_id)
        if n > self.pool.num_free_blocks:
            return None
        blocks = self.pool.get_new_blocks(n)
        self._tables[request_id] = blocks
        for b, h in zip(blocks, self._hashes[request_id][self._skipped[request_id]:]):
            if h is not None and self.pool.get_cached_block(h) is None:
                self.pool.cache_block(b, h)
        return self.host.swap_in(request_id, [b.block_id for b in blocks])

    # -- pool size and layout (the pool does the work, tables follow) ------------------------------
    @property
    def max_num_blocks(self) -> int:
        """The most blocks the pool may ever hold (above ``num_blocks`` for an elastic pool)."""
        return max(self._max_blocks, self.pool.num_blocks)

    def set_max_num_blocks(self, n: int) -> None:
        self._max_blocks = n

    def fragmentation(self) -> int:
        """Referenced blocks at ids >= num_used_blocks (what ``compact`` would move)."""
        return self.pool.fragmentation()

    def compact(self) -> list[tuple[int, int]]:
        """Move referenced blocks to the lowest ids (``BlockPool.compact``); tables follow.
        Returns the (src, dst) moves to apply. Between steps only (no copy-on-write pending)."""
        assert not self.cow.pending, "compact() between steps only (copy-on-write copies pending)"
        remap = self.pool.compact()
        if remap:
            for table in self._tables.values():
                for i, b in enumerate(table):
                    table[i] = remap.get(b.block_id, b)
        return [(s, d.block_id) for s, d in remap.items()]

    def grow(self, n: int) -> None:
        """Add ``n`` fresh blocks (ids num_blocks .. num_blocks + n - 1)."""
        self.pool.grow(n)

    def shrink(self, n: int) -> bool:
        """Drop blocks ``n`` .. end if all are free (call ``compact`` first); False otherwise."""
        return self.pool.shrink(n)

    def check_integrity(self) -> None:
        """Pool invariants, plus: each block's ref_cnt equals the number of tables holding it,
        no table holds a block twice, per-request hashes never outrun the table, and only a
        windowed manager skips positions (a held block always remains)."""
        refs: dict[int, int] = {}
        for rid, table in self._tables.items():
            ids = [b.block_id for b in table]
            assert len(set(ids)) == len(ids), f"request {rid!r} holds a block twice: {ids}"
            for i in ids:
                refs[i] = refs.get(i, 0) + 1
            hashes, skip = self._hashes[rid], self._skipped[rid]
            assert not skip or (self.window is not None and table), (
                f"request {rid!r} skips {skip} blocks (window {self.sliding_window}, "
                f"{len(table)} held)")
            assert len(hashes) <= skip + len(table), f"request {rid!r}: more hashes than blocks"
            assert None not in hashes[skip:], f"request {rid!r}: a held block's hash is unknown"
            for b, h in zip(table[:max(0, len(hashes) - skip)], hashes[skip:], strict=True):
                assert b.block_hash is None or b.block_hash == h, (
                    f"request {rid!r}: block {b.block_id} is cached under another hash")
            for b in table[max(0, len(hashes) - skip):]:
                assert b.block_hash is None, f"request {rid!r}: unhashed position holds {b}"
        swapped = self.host.requests
        assert not (swapped & self._tables.keys()), "a request is on both tiers"
        assert self._hashes.keys() == self._tables.keys() | swapped == self._skipped.keys(), (
            "hash lists, offsets and tables disagree")
        self.host.check_integrity()
        self.pool.check_integrity(refs)
