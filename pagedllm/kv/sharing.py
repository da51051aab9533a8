"""Copy-on-write for shared blocks: which shared partial blocks must be copied, and the copies.

Sharing (``KVCacheManager.fork``): n > 1 samples and beams share a parent's blocks by reference
count. Only the block holding the fork point may be partially filled; each sharer records its
table index here and, on its next ``allocate_slots`` (which precedes every write), copies it to a
fresh block if it is still shared. The copies are queued as (src, dst) pairs that the runner
applies in one batched move before the forward (``take``)::

    parent  [ 7 | 2 | 5 ]      fork at 10 tokens (bs 4): blocks 7, 2 shared; 5 holds 2 tokens
    child   [ 7 | 2 | 5 ]      ref_cnt 7:2 2:2 5:2
    child writes token 10  ─▶  child [ 7 | 2 | 9 ], copy (5 -> 9); parent writes into 5 in place
"""

from __future__ import annotations

from pagedllm.kv.block_pool import BlockPool, KVBlock


class CopyOnWrite:
    """Per request: the table index of a shared partial block. Per step: copies not yet made."""

    def __init__(self) -> None:
        self._index: dict[str, int] = {}
        self._copies: list[tuple[int, int]] = []  # (src, dst) block copies not yet taken

    @property
    def pending(self) -> list[tuple[int, int]]:
        """The copies made since the last ``take`` (read-only view: do not modify)."""
        return self._copies

    def mark(self, request_id: str, index: int) -> None:
        self._index[request_id] = index

    def share(self, pool: BlockPool, parent_id: str, parent: list[KVBlock], child_id: str,
              num_tokens: int, block_size: int) -> list[KVBlock]:
        """A fork's table: the parent's held blocks covering its next ``num_tokens`` tokens
        (counted from its first held block), referenced once more; a partial last block is marked
        for copy-on-write in both tables."""
        n = -(-num_tokens // block_size)
        if n > len(parent):
            raise ValueError(f"fork at {num_tokens} tokens past {parent_id!r}'s first held block, "
                             f"but it holds {len(parent)} blocks")
        if n < 1:
            raise ValueError(f"fork of {parent_id!r} before its first held block (freed behind "
                             "its sliding window)")
        shared = parent[:n]
        pool.touch(shared)
        if num_tokens % block_size:
            self.mark(child_id, n - 1)
            self.mark(parent_id, n - 1)
        return list(shared)

    def shift(self, request_id: str, n: int) -> None:
        """The request's first ``n`` table entries were dropped (sliding window): reindex."""
        idx = self._index.get(request_id)
        if idx is not None:
            if idx < n:
                del self._index[request_id]
            else:
                self._index[request_id] = idx - n

    def needs_copy(self, request_id: str, table: list[KVBlock]) -> bool:
        idx = self._index.get(request_id)
        return idx is not None and idx < len(table) and table[idx].ref_cnt > 1

    def before_write(self, request_id: str, table: list[KVBlock], pool: BlockPool) -> None:
        """Replace a still-shared partial block of ``table`` by a private copy (one free block)."""
        idx = self._index.pop(request_id, None)
        if idx is not None and idx < len(table) and table[idx].ref_cnt > 1:
            (new,) = pool.get_new_blocks(1)
            pool.free_blocks([table[idx]])  # still held by the other sharers
            self._copies.append((table[idx].block_id, new.block_id))
            table[idx] = new

    def take(self) -> list[tuple[int, int]]:
        copies, self._copies = self._copies, []
        return copies

    def forget(self, request_id: str, table: list[KVBlock] | None) -> None:
        """The request leaves the device (freed): a copy into a block that only it holds is moot."""
        self._index.pop(request_id, None)
        if table is not None and self._copies:
            gone = {b.block_id for b in table if b.ref_cnt == 1}
            self._copies = [c for c in self._copies if c[1] not in gone]

    def sources(self, request_id: str, table: list[KVBlock]) -> list[int]:
        """For a swap-out: the block ids to read ``table`` from. A copy into one of its blocks has
        not run yet, so its source is read instead and the copy is dropped."""
        self._index.pop(request_id, None)
        pending = {dst: src for src, dst in self._copies}
        mine = {b.block_id for b in table}
        self._copies = [c for c in self._copies if c[1] not in mine]
        return [pending.get(b.block_id, b.block_id) for b in table]
