"""Block sharing on top of ``KVCacheManager``: fork with copy-on-write, and pinned prefixes.

Sharing (``fork``): n > 1 samples and beams share a parent's blocks by reference count. Only the
block holding the fork point may be partially filled; each sharer records its table index in
``_cow`` and, on its next ``allocate_slots`` (which precedes every write), copies it to a fresh
block if it is still shared. The copies are queued as (src, dst) pairs that the runner applies in
one batched move before the forward (``take_block_copies``)::

    parent  [ 7 | 2 | 5 ]      fork at 10 tokens (bs 4): blocks 7, 2 shared; 5 holds 2 tokens
    child   [ 7 | 2 | 5 ]      ref_cnt 7:2 2:2 5:2
    child writes token 10  ─▶  child [ 7 | 2 | 9 ], copy (5 -> 9); parent writes into 5 in place

Pinning (warm-up): ``pin`` takes one reference on the cached blocks of a prompt's prefix under a
pseudo-request id, so that they are never evicted; ``unpin_all`` releases them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedllm.kv.block_pool import BlockHash, BlockPool, KVBlock

if TYPE_CHECKING:
    from pagedllm.kv.manager import PrefixHit
    from pagedllm.kv.trace import KVTracer

PIN_PREFIX = "__pinned__/"


class SharingMixin:
    """Mixed into ``KVCacheManager``; uses its tables, hashes and pool."""

    block_size: int
    pool: BlockPool
    _tables: dict[str, list[KVBlock]]
    _hashes: dict[str, list[BlockHash]]
    _cow: dict[str, int]
    _copies: list[tuple[int, int]]
    _pins: list[str]
    tracer: KVTracer | None

    if TYPE_CHECKING:  # provided by KVCacheManager
        def find_prefix(self, token_ids: Sequence[int], extra_keys: tuple | None = None,
                        record_stats: bool = True) -> PrefixHit: ...

        def allocate_slots(self, request_id: str, num_total_tokens: int,
                           prefix: PrefixHit | None = None, *, urgent: bool = False) -> bool: ...

        def free(self, request_id: str) -> None: ...

    def _needs_copy(self, request_id: str, table: list[KVBlock]) -> bool:
        idx = self._cow.get(request_id)
        return idx is not None and idx < len(table) and table[idx].ref_cnt > 1

    def _copy_on_write(self, request_id: str, table: list[KVBlock]) -> None:
        """Before a write: replace a still-shared partial block by a private copy."""
        idx = self._cow.pop(request_id, None)
        if idx is not None and idx < len(table) and table[idx].ref_cnt > 1:
            (new,) = self.pool.get_new_blocks(1)
            self.pool.free_blocks([table[idx]])  # still held by the other sharers
            self._copies.append((table[idx].block_id, new.block_id))
            if self.tracer is not None:
                self.tracer.emit("cow_copy", rid=request_id, src=table[idx].block_id,
                                 dst=new.block_id)
            table[idx] = new

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> None:
        """Give ``child_id`` the parent's blocks covering its first ``num_tokens`` (computed)
        tokens, by reference. Takes no free block; a shared partial last block is copied on the
        next write of whichever sharer writes first (see the module docstring)."""
        if child_id in self._tables:
            raise ValueError(f"request {child_id!r} already has blocks")
        parent = self._tables.get(parent_id)
        if parent is None:
            raise KeyError(f"no blocks allocated for request {parent_id!r}")
        n_blocks = -(-num_tokens // self.block_size)
        if n_blocks > len(parent):
            raise ValueError(f"fork at {num_tokens} tokens but {parent_id!r} holds "
                             f"{len(parent)} blocks")
        shared = parent[:n_blocks]
        self.pool.touch(shared)
        self._tables[child_id] = list(shared)
        self._hashes[child_id] = self._hashes[parent_id][:num_tokens // self.block_size]
        if num_tokens % self.block_size:
            self._cow[child_id] = self._cow[parent_id] = n_blocks - 1
        if self.tracer is not None:
            self.tracer.emit("fork", parent=parent_id, child=child_id, num_tokens=num_tokens,
                             blocks=[b.block_id for b in shared])

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) copies made by ``allocate_slots`` since the last call; the runner must
        apply them (in one batch) before writing into the dst blocks."""
        copies, self._copies = self._copies, []
        if self.tracer is not None and copies:
            self.tracer.emit("take_copies", copies=[list(c) for c in copies])
        return copies

    # -- pinned prefixes (warm-up) ---------------------------------------------------------------
    def pin(self, token_ids: Sequence[int]) -> int:
        """Pin the cached full blocks at the head of ``token_ids`` (as ``find_prefix`` finds
        them); returns how many blocks were pinned."""
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
