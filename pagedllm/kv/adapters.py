"""LoRA adapters' pages in the KV block pool (unified paging, after S-LoRA).

An adapter resident on the device holds blocks of the same ``BlockPool`` the KV cache uses:
its weights are written into those blocks' bytes (runner/kv_cache.py ``write_pages``), so KV and
adapters share one pool and one count of blocks. An adapter needs ``ceil(its largest layer's
A and B bytes / one block's bytes per layer)`` blocks (``register``, from the runner)::

    pool   [ KV ][ KV ][ lora 3 ][ KV ][ free ][ lora 3 ][ lora 7 ][ cached ] ...
            held by tables      held here (ref_cnt 1, no hash)   evictable by either side

Residency is decided by the scheduler (sched/scheduler.py), in its queue order:

- ``ensure(id, keep)`` before a request is admitted: resident already (LRU touched), or made
  resident in free blocks, evicting idle adapters (least recently used first, none in ``keep``:
  the adapters of the requests holding KV) until they fit; else None and the request waits.
- ``evict_idle(keep)`` when the KV cache runs short, before any request is preempted: an idle
  adapter's blocks go back to the free queue; its weights stay in the host tier (the runner's
  host LRU, then the adapter's files) and are paged in again on demand.

What a step changed travels in its ``KVUpdate`` (``lora_loads``, ``lora_evictions``):
``take_changes`` hands them over. Compaction moves the blocks in ``held`` (between steps, when
no page-in is pending). Pure Python.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

from pagedllm.kv.block_pool import BlockPool, KVBlock


class AdapterPages:
    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.sizes: dict[int, int] = {}  # adapter id -> blocks its weights need
        self.held: OrderedDict[int, list[KVBlock]] = OrderedDict()  # resident, LRU first
        self._loads: list[int] = []  # this step's page-ins (their blocks: ``held``)
        self._evictions: list[int] = []  # this step's page-outs
        self.num_loads = 0  # adapters paged in, in all
        self.num_evictions = 0  # adapters paged out to make room, in all

    def register(self, lora_id: int, num_blocks: int) -> None:
        """How many blocks adapter ``lora_id`` takes when resident (the runner measured it)."""
        if num_blocks < 1:
            raise ValueError(f"an adapter needs at least one block, got {num_blocks}")
        self.sizes[lora_id] = num_blocks

    @property
    def num_blocks(self) -> int:
        """Blocks held by resident adapters."""
        return sum(len(b) for b in self.held.values())

    @property
    def resident(self) -> list[int]:
        """Resident adapter ids, least recently used first."""
        return list(self.held)

    def blocks_of(self, lora_id: int) -> list[int]:
        return [b.block_id for b in self.held[lora_id]]

    def ensure(self, lora_id: int, keep: Collection[int]) -> bool:
        """Make ``lora_id`` resident (see the module docstring); False (nothing changed but
        idle adapters paged out) if it cannot be now."""
        if lora_id in self.held:
            self.held.move_to_end(lora_id)
            return True
        n = self.sizes[lora_id]
        keep = {*keep, lora_id}
        while self.pool.num_free_blocks < n:
            if self.evict_idle(keep) is None:
                return False
        blocks = self.pool.get_new_blocks(n)
        self.held[lora_id] = blocks
        self._loads.append(lora_id)
        self.num_loads += 1
        return True

    def evict_idle(self, keep: Collection[int]) -> int | None:
        """Page out the least recently used resident adapter not in ``keep``: its id, or None
        if every resident one is kept."""
        victim = next((i for i in self.held if i not in keep), None)
        if victim is not None:
            self.pool.free_blocks(self.held.pop(victim))
            if victim in self._loads:
                self._loads.remove(victim)
            self._evictions.append(victim)
            self.num_evictions += 1
        return victim

    def take_changes(self) -> tuple[list[tuple[int, list[int]]], list[int]]:
        """This step's (page-ins as (id, block ids), page-outs), cleared. Page-outs first: an
        adapter paged out and in again in one step is loaded afresh. The block ids are read
        now, from ``held``: a compaction since the page-in has moved them."""
        loads = [(i, self.blocks_of(i)) for i in self._loads]
        evictions = self._evictions
        self._loads, self._evictions = [], []
        return loads, evictions

    def add_refs(self, refs: dict[int, int]) -> None:
        """Add the references held here (one per block) to ``refs`` (block id -> holders), for
        ``check_integrity``; a block held here and by a table is an error."""
        for blocks in self.held.values():
            for b in blocks:
                assert b.block_id not in refs, f"block {b.block_id} is held by an adapter and a table"
                refs[b.block_id] = 1


__all__ = ["AdapterPages"]
