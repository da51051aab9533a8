"""Per-request block tables (kv/tables.py) and prefix caching on top of ``BlockPool``.

Only full blocks whose tokens are all computed are hashed (once, kept on the request) and
registered in the pool's index. ``find_prefix`` walks a new prompt's hash chain through the index;
the hit blocks become the head of the new request's table, shared by reference count (the hashes
and the walk: kv/prefix.py).

The manager holds its parts: the ``RequestTables`` (blocks held and hashes per request,
kv/tables.py), the ``BlockPool`` (blocks, free queue, hash index, pool size), a ``CopyOnWrite``
(shared partial blocks and pending copies, kv/sharing.py), a ``HostTier`` (swap plans,
kv/host_tier.py), a ``SlidingWindow`` (kv/window.py: blocks wholly behind every later query's
window are freed as the request advances) and ``AdapterPages`` (LoRA adapters' pages in the same
pool, kv/adapters.py). What each public mutating call did is
published on ``events`` (kv/events.py), the one way to observe it (the trace, the ZMQ publisher,
the inspector subscribe); no event is built unless somebody listens (``if self.events.ops``).
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedllm.kv import events as ev
from pagedllm.kv.adapters import AdapterPages
from pagedllm.kv.block_pool import BlockHash, BlockPool, KVBlock
from pagedllm.kv.host_tier import HostTier
from pagedllm.kv.prefix import (
    PrefixCacheStats,
    PrefixHit,
    held_blocks_of_hit,
    longest_cached_prefix,
    make_block_hash,
)
from pagedllm.kv.sharing import CopyOnWrite
from pagedllm.kv.tables import RequestTables
from pagedllm.kv.window import SlidingWindow

__all__ = ["KVCacheManager", "PrefixCacheStats", "PrefixHit", "make_block_hash"]

PIN_PREFIX = "__pinned__/"


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
        self.events = ev.KVEventBus()  # subscribe here (kv/events.py); the pool publishes too
        self.pool = BlockPool(num_blocks, self.events)
        self.cow = CopyOnWrite()
        self.host = HostTier(num_host_blocks)
        self.window = None if sliding_window is None else SlidingWindow(sliding_window, block_size)
        self.stats = PrefixCacheStats()
        self.tables = RequestTables()  # blocks held, window offsets, hashes: per request
        self.adapters = AdapterPages(self.pool)  # LoRA adapters' pages (kv/adapters.py)
        self._pins: list[str] = []  # pseudo-requests holding pinned (preheated) prefix blocks
        self.num_window_freed = 0  # blocks freed behind the sliding window, in all
        self._max_blocks = num_blocks

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
        return len(self.tables.hashes)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.tables.held

    @property
    def sliding_window(self) -> int | None:
        return None if self.window is None else self.window.window

    # queries on one request's table (kv/tables.py)
    def block_table(self, request_id: str) -> list[int]:
        return self.tables.block_table(request_id)

    def held_blocks(self, request_id: str) -> list[int]:
        return self.tables.held_blocks(request_id)

    def num_blocks_of(self, request_id: str) -> int:
        """Device blocks the request holds (0 if none; placeholders not counted)."""
        return len(self.tables.held.get(request_id, ()))

    def num_shared_blocks_of(self, request_id: str) -> int:
        return self.tables.num_shared(request_id)

    def num_skipped_blocks(self, request_id: str) -> int:
        """Leading positions of the table whose blocks were freed behind the sliding window."""
        return self.tables.skipped[request_id]

    def block_hashes(self, request_id: str) -> list[BlockHash | None]:
        """A copy of the hashes of the request's leading full, computed blocks, by position."""
        return list(self.tables.hashes.get(request_id, ()))

    # -- prefix lookup ------------------------------------------------------------------------
    def find_prefix(self, token_ids: Sequence[int], extra_keys: tuple | None = None,
                    record_stats: bool = True) -> PrefixHit:
        """Longest chain of cached full blocks at the head of ``token_ids``, covering at most
        ``len(token_ids) - 1`` tokens (the last prompt token is always recomputed: its logits).
        Takes no references; counts ``stats`` unless ``record_stats`` is False (the scheduler
        looks up on every admission attempt and records once, with ``record_prefix_query``)."""
        if not self.enable_prefix_caching:
            return PrefixHit([], 0)
        hit = longest_cached_prefix(self.pool, token_ids, self.block_size, extra_keys,
                                    self.window)
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
        table = self.tables.held.get(request_id)
        have = len(table) + self.tables.skipped[request_id] if table is not None else 0  # positions
        revive = 0
        if table is None and prefix is not None:
            have = prefix.num_skipped + len(prefix.blocks)
            revive = sum(1 for i in prefix.blocks if self.pool.blocks[i].ref_cnt == 0)
        cow = 1 if table is not None and self.cow.needs_copy(request_id, table) else 0
        return max(0, -(-num_total_tokens // self.block_size) - have) + revive + cow

    def allocate_slots(self, request_id: str, num_total_tokens: int,
                       prefix: PrefixHit | None = None) -> bool:
        """Make ``request_id``'s table cover ``num_total_tokens`` slots; False (no change at all)
        if the pool lacks free blocks. ``prefix`` is only accepted on the first call."""
        table = self.tables.held.get(request_id)
        hit: list[KVBlock] = []
        hit_hashes: list[BlockHash | None] = []
        if prefix is not None and prefix.blocks:
            if table is not None:
                raise ValueError(f"request {request_id!r} already has blocks; a prefix hit "
                                 "can only seed a new request's table")
            if not self.enable_prefix_caching:
                raise ValueError("prefix hit passed while prefix caching is disabled")
            hit = held_blocks_of_hit(self.pool, prefix, num_total_tokens, self.block_size,
                                     self.window)
            hit_hashes = [b.block_hash for b in hit]
        skip = prefix.num_skipped if prefix is not None and hit else 0
        if self.num_blocks_needed(request_id, num_total_tokens, prefix) > self.pool.num_free_blocks:
            if self.events.ops:
                ev.publish_allocate(self.events, request_id, num_total_tokens, hit, skip, None)
            return False
        if ops := self.events.ops:  # the op event names the blocks and copies this call adds
            num_before, copies_before = len(hit if table is None else table), len(self.cow.pending)
        if table is None:
            self.pool.touch(hit, prefix_hit=True)  # before get_new_blocks: keeps our own prefix
            table = self.tables.held[request_id] = list(hit)
            self.tables.skipped[request_id] = skip
            self.tables.hashes[request_id] = [*[None] * skip, *hit_hashes]
        self.cow.before_write(request_id, table, self.pool)
        n_new = -(-num_total_tokens // self.block_size) - len(table)  # positions to add ...
        n_new -= self.tables.skipped[request_id]  # ... past those freed behind the window
        if n_new > 0:
            table.extend(self.pool.get_new_blocks(n_new))
        if ops:
            ev.publish_allocate(self.events, request_id, num_total_tokens, hit, skip,
                                table[num_before:], self.cow.pending[copies_before:])
        return True

    def cache_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int,
                     extra_keys: tuple | None = None) -> None:
        """Hash and register the request's blocks that became full and fully computed, each once
        (the chain is kept per request); an identical block already indexed stays indexed, the
        request keeps its copy. Unknown ids (e.g. aborted between schedule and update): no-op."""
        table = self.tables.held.get(request_id)
        if not self.enable_prefix_caching or table is None:
            return
        hashes = self.tables.hashes[request_id]
        bs, skip = self.block_size, self.tables.skipped[request_id]
        num_full = min(num_computed_tokens, len(token_ids), (skip + len(table)) * bs) // bs
        if hashes and hashes[-1] is None:
            return  # the chain's parent is unknown (a replayed windowed hit): cannot extend it
        start = len(hashes)
        for i in range(start, num_full):
            h = make_block_hash(hashes[-1] if hashes else None, token_ids[i * bs:(i + 1) * bs],
                                extra_keys)
            if i >= skip:  # a block freed behind the window is never hashed into the index
                self.pool.cache_block(table[i - skip], h)
            hashes.append(h)
        if num_full > start and self.events.ops:
            self.events.publish(ev.Cached(
                request_id, start, list(token_ids[start * bs:num_full * bs]),
                self.tables.positions(request_id)[start:num_full],
                [ev.hash_hex(h.value) for h in hashes[start:] if h is not None],
                None if extra_keys is None else list(extra_keys)))

    def free_outside_window(self, request_id: str, num_computed_tokens: int) -> int:
        """Free the blocks wholly before the window of every token after the first
        ``num_computed_tokens`` (after ``cache_blocks``: they are hashed). Returns how many; the
        oldest is queued (evicted) first. Unknown ids are ignored."""
        table = self.tables.held.get(request_id)
        if self.window is None or table is None:
            return 0
        skip = self.tables.skipped[request_id]
        n = min(self.window.first_needed_block(num_computed_tokens) - skip, len(table) - 1)
        if n <= 0:
            return 0
        gone, table[:n] = table[:n], []
        self.tables.skipped[request_id] = skip + n
        self.cow.shift(request_id, n)
        self.pool.free_blocks(gone)
        self.num_window_freed += n
        if self.events.ops:
            self.events.publish(ev.WindowFreed(request_id, num_computed_tokens,
                                               [b.block_id for b in gone]))
        return n

    def rollback(self, request_id: str, num_tokens: int) -> list[int]:
        """Speculative decoding: free (and return) the held blocks past the first ``num_tokens``
        positions, the step's private, unhashed slots of rejected proposals."""
        table, skip = self.tables.held.get(request_id, []), self.tables.skipped.get(request_id, 0)
        keep = -(-num_tokens // self.block_size) - skip  # held blocks kept
        gone = table[keep:]
        assert not gone or len(self.tables.hashes[request_id]) <= keep + skip and all(
            b.ref_cnt == 1 and b.block_hash is None for b in gone), "rollback past a hash or a share"
        del table[keep:]
        self.pool.free_blocks(reversed(gone))
        freed = [b.block_id for b in gone]
        if self.events.ops and freed:
            self.events.publish(ev.RolledBack(request_id, num_tokens, freed))
        return freed

    def free(self, request_id: str) -> None:
        """Release the request's blocks, last block first: among its cached blocks the deepest
        is evicted first. Unknown ids are a no-op."""
        if self.events.ops and request_id in self.tables.hashes:  # held or swapped out
            held = self.tables.positions(request_id) if request_id in self.tables.held else []
            self.events.publish(ev.Freed(request_id, held, self.host.holds(request_id)))
        table = self.tables.held.pop(request_id, None)
        self.tables.hashes.pop(request_id, None)
        self.tables.skipped.pop(request_id, None)
        self.host.drop(request_id)
        self.cow.forget(request_id, table)
        if table is not None:
            self.pool.free_blocks(reversed(table))

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; refused (False) while any request holds blocks."""
        ok = not any(self.tables.held.values()) and self.pool.reset_prefix_cache(
            self.adapters.num_blocks)  # adapters' pages: held, never hashed
        if self.events.ops:
            self.events.publish(ev.PrefixCacheReset(ok))
        return ok

    # -- sharing: fork (copy-on-write, kv/sharing.py) and pinned prefixes --------------------------
    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> None:
        """Give ``child_id`` the parent's blocks of its first ``num_tokens`` (computed) tokens by
        reference, taking no free block; a shared partial last block is copied on the next write."""
        if child_id in self.tables.held:
            raise ValueError(f"request {child_id!r} already has blocks")
        skip = self.tables.skipped[parent_id] if parent_id in self.tables.held else 0
        self.tables.held[child_id] = self.cow.share(
            self.pool, parent_id, self.tables.table(parent_id), child_id,
            num_tokens - skip * self.block_size, self.block_size)
        self.tables.skipped[child_id] = skip
        self.tables.hashes[child_id] = self.tables.hashes[parent_id][:num_tokens // self.block_size]
        if self.events.ops:
            self.events.publish(ev.Forked(parent_id, child_id, num_tokens,
                                          self.tables.positions(child_id)))

    def take_block_copies(self) -> list[tuple[int, int]]:
        """``allocate_slots``'s (src, dst) copies since the last call, to apply before dst is written."""
        copies = self.cow.take()
        if self.events.ops and copies:
            self.events.publish(ev.CopiesTaken([list(c) for c in copies]))
        return copies

    def pin(self, token_ids: Sequence[int]) -> int:
        """Warm-up: hold ``find_prefix``'s hit for ``token_ids`` under a pseudo-request, never
        evicted until ``unpin_all``; returns how many blocks were pinned."""
        hit = self.find_prefix(token_ids, record_stats=False)
        if not hit.blocks:
            return 0
        pin_id = f"{PIN_PREFIX}{len(self._pins)}"
        assert self.allocate_slots(pin_id, hit.num_tokens, hit), "pinning takes no free block"
        self._pins.append(pin_id)
        return len(hit.blocks)

    @property
    def num_pinned_blocks(self) -> int:
        return len({b.block_id for p in self._pins for b in self.tables.held[p]})

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
        """Move the request's held blocks to the host tier: (device, host) pairs to copy, or None
        (nothing changed) if it lacks room. The request keeps its computed count, prefix hashes
        and window offset; its device blocks are freed (shared ones stay with their holders)."""
        table = self.tables.table(request_id)
        pairs = None
        if len(table) <= self.host.num_free_blocks:
            pairs = self.host.swap_out(request_id, self.cow.sources(request_id, table))
            assert pairs is not None
            del self.tables.held[request_id]
            self.pool.free_blocks(reversed(table))
        if self.events.ops:
            self.events.publish(ev.SwappedOut(request_id, ev.pairs(pairs)))
        return pairs

    def swap_in(self, request_id: str) -> list[tuple[int, int]] | None:
        """Bring a swapped request back into fresh device blocks: (host, device) pairs, or None
        (no change) if too few are free. Its hashes re-register where no other block holds them."""
        n = self.host.num_blocks_of(request_id)
        pairs = None
        if n <= self.pool.num_free_blocks:
            blocks = self.pool.get_new_blocks(n)
            self.tables.held[request_id] = blocks
            skip = self.tables.skipped[request_id]
            for b, h in zip(blocks, self.tables.hashes[request_id][skip:]):
                if h is not None and self.pool.get_cached_block(h) is None:
                    self.pool.cache_block(b, h)
            pairs = self.host.swap_in(request_id, [b.block_id for b in blocks])
        if self.events.ops:
            self.events.publish(ev.SwappedIn(request_id, ev.pairs(pairs)))
        return pairs

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
        """Move live blocks to the lowest ids (``BlockPool.compact``); tables and adapters follow.
        Returns the (src, dst) moves to apply. Between steps only (no copy-on-write pending)."""
        assert not self.cow.pending, "compact() between steps only (copy-on-write copies pending)"
        remap = self.pool.compact()
        for blocks in [*self.tables.held.values(), *self.adapters.held.values()]:
            blocks[:] = [remap.get(b.block_id, b) for b in blocks]
        return [(s, d.block_id) for s, d in remap.items()]

    def grow(self, n: int) -> None:
        """Add ``n`` fresh blocks (ids num_blocks .. num_blocks + n - 1)."""
        self.pool.grow(n)

    def shrink(self, n: int) -> bool:
        """Drop blocks ``n`` .. end if all are free (call ``compact`` first); False otherwise."""
        return self.pool.shrink(n)

    def check_integrity(self) -> None:
        """Pool and table invariants (``RequestTables.check``), plus: each block's ref_cnt
        equals the number of tables (and adapters) holding it."""
        refs = self.tables.check(self.window is not None, set(self.host.requests))
        self.adapters.add_refs(refs)  # resident LoRA adapters' pages
        self.host.check_integrity()
        self.pool.check_integrity(refs)
