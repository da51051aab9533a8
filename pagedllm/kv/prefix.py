"""What a prefix-cache lookup returns (``PrefixHit``) and counts (``PrefixCacheStats``).

The lookup itself, and the block hashes it walks, are ``KVCacheManager.find_prefix``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from pagedllm.kv.block_pool import BlockHash


class PrefixHit(NamedTuple):
    """Cached full blocks that cover the head of a prompt. Holds no references.

    ``hashes`` (filled by ``find_prefix``) lets ``allocate_slots`` detect a hit that went stale
    because one of its blocks was evicted in between. With a sliding window the first
    ``num_skipped`` blocks of the hit are not needed (wholly before the window of the first token
    to compute) and not held: ``blocks`` covers the positions after them, and
    ``num_tokens == (num_skipped + len(blocks)) * block_size``.
    """

    blocks: list[int]
    num_tokens: int
    hashes: tuple[BlockHash, ...] = ()
    num_skipped: int = 0


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
