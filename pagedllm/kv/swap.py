"""The host-memory tier: swapping a preempted request's blocks out to host memory and back.

    device pool   [ 0 1 2 3 4 5 6 7 ]        swap_out(r): r's table [5, 2, 7] -> host [0, 1, 2]
    host pool     [ 0 1 2 3 ]                device blocks freed (shared ones stay with their
                                             other holders), r keeps its computed count
                  swap_in(r): fresh device blocks [1, 3, 4] <- host [0, 1, 2], host freed

The manager only plans: it returns (src, dst) pairs that the runner moves in one batch per
direction. A request's prefix hashes survive the round trip and are re-registered on swap-in when
no other block holds them. ``PreemptionCost`` is the estimate ``preemption_mode="auto"`` uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedllm.kv.block_pool import BlockHash, BlockPool, KVBlock

if TYPE_CHECKING:
    from collections.abc import Iterable

    from pagedllm.kv.trace import KVTracer


@dataclass(frozen=True)
class PreemptionCost:
    """Rough cost model: recomputing ``t`` tokens costs ``flops_per_token * t / flops_per_s``
    seconds; swapping ``b`` blocks out and back costs ``2 * b * bytes_per_block / bytes_per_s``.
    The engine fills it from the model size and device; the defaults fit a small model on CPU."""

    flops_per_token: float = 2e8
    bytes_per_block: float = 2**17
    flops_per_s: float = 5e10
    bytes_per_s: float = 5e9

    def recompute_s(self, num_tokens: int) -> float:
        return self.flops_per_token * num_tokens / self.flops_per_s

    def swap_s(self, num_blocks: int) -> float:
        return 2 * num_blocks * self.bytes_per_block / self.bytes_per_s


class SwapMixin:
    """Mixed into ``KVCacheManager``: host block allocation and swap plans."""

    pool: BlockPool
    _tables: dict[str, list[KVBlock]]
    _hashes: dict[str, list[BlockHash]]
    _copies: list[tuple[int, int]]
    _cow: dict[str, int]
    num_host_blocks: int
    _host_free: list[int]
    _swapped: dict[str, list[int]]  # request id -> host block ids, in table order
    swap_stats: dict[str, int]
    tracer: KVTracer | None

    def _init_swap(self, num_host_blocks: int) -> None:
        self.num_host_blocks = num_host_blocks
        self._host_free = list(range(num_host_blocks - 1, -1, -1))  # pop() hands out 0, 1, ...
        self._swapped = {}
        self.swap_stats = {"out": 0, "in": 0}

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._host_free)

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self._swapped

    def num_swap_in_blocks(self, request_id: str) -> int:
        return len(self._swapped[request_id])

    def swap_out(self, request_id: str) -> list[tuple[int, int]] | None:
        """Move the request's blocks to the host tier: (device, host) pairs to copy, or None
        (nothing changed) if the host tier lacks room."""
        table = self._tables.get(request_id)
        if table is None:
            raise KeyError(f"no blocks allocated for request {request_id!r}")
        if len(table) > len(self._host_free):
            if self.tracer is not None:
                self.tracer.emit("swap_out", rid=request_id, pairs=None)
            return None
        # a copy-on-write copy into one of these blocks has not run yet: read its source instead
        pending = {dst: src for src, dst in self._copies}
        mine = {b.block_id for b in table}
        self._copies = [c for c in self._copies if c[1] not in mine]
        host = [self._host_free.pop() for _ in table]
        pairs = [(pending.get(b.block_id, b.block_id), h) for b, h in zip(table, host)]
        del self._tables[request_id]
        self._cow.pop(request_id, None)
        self._swapped[request_id] = host
        self.pool.free_blocks(reversed(table))
        self.swap_stats["out"] += len(table)
        if self.tracer is not None:
            self.tracer.emit("swap_out", rid=request_id, pairs=[list(p) for p in pairs])
        return pairs

    def swap_in(self, request_id: str) -> list[tuple[int, int]] | None:
        """Bring a swapped request back: (host, device) pairs to copy, or None (nothing changed)
        if the device pool lacks free blocks."""
        host = self._swapped[request_id]
        if len(host) > self.pool.num_free_blocks:
            if self.tracer is not None:
                self.tracer.emit("swap_in", rid=request_id, pairs=None)
            return None
        del self._swapped[request_id]
        blocks = self.pool.get_new_blocks(len(host))
        self._tables[request_id] = blocks
        for b, h in zip(blocks, self._hashes[request_id]):
            if self.pool.get_cached_block(h) is None:
                self.pool.cache_block(b, h)
        self._host_free.extend(reversed(host))
        self.swap_stats["in"] += len(host)
        pairs = [(h, b.block_id) for h, b in zip(host, blocks)]
        if self.tracer is not None:
            self.tracer.emit("swap_in", rid=request_id, pairs=[list(p) for p in pairs])
        return pairs

    def _drop_swapped(self, request_id: str) -> None:
        host = self._swapped.pop(request_id, None)
        if host is not None:
            self._host_free.extend(reversed(host))
            self._hashes.pop(request_id, None)

    def _check_swap_integrity(self) -> None:
        held: Iterable[int] = (h for hs in self._swapped.values() for h in hs)
        ids = sorted([*held, *self._host_free])
        assert ids == list(range(self.num_host_blocks)), f"host blocks lost or doubled: {ids}"
        assert not (self._swapped.keys() & self._tables.keys()), "a request is on both tiers"
        assert self._swapped.keys() <= self._hashes.keys(), "a swapped request lost its hashes"


def choose_preemption(mode: str, cost: PreemptionCost, num_computed_tokens: int,
                      num_blocks: int, num_free_host_blocks: int) -> tuple[str, str]:
    """("swap" | "recompute", why) for one victim under ``preemption_mode``."""
    if mode == "recompute":
        return "recompute", "preemption_mode=recompute"
    if num_blocks > num_free_host_blocks:
        return "recompute", (f"host tier has {num_free_host_blocks} free blocks, "
                             f"victim holds {num_blocks}")
    if mode == "swap":
        return "swap", "preemption_mode=swap"
    rec, swp = cost.recompute_s(num_computed_tokens), cost.swap_s(num_blocks)
    how = "swap" if swp < rec else "recompute"
    return how, (f"auto: recompute {num_computed_tokens} tokens ~{rec * 1e3:.3f} ms vs swap "
                 f"{num_blocks} blocks out+in ~{swp * 1e3:.3f} ms")
