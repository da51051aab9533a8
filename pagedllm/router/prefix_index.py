"""What a router knows of each replica's prefix cache: the exact set of chained block hashes the
replica's KV events say it holds, plus the blocks of requests routed there and not yet finished
("soon cached"). Pure Python, no torch.

A request's blocks are hashed exactly as the KV manager hashes them (``kv.prefix.make_block_hash``
over each full block, chained from the prompt's start, ``extra_keys`` as the request's
``prefix_keys``), then written as the events write them (``kv.events.hash_hex``). So a replica
holds a request's first k blocks iff their k hashes are in its set: the longest match is exact,
not a radix-tree approximation of the text::

    prompt   [ b0 | b1 | b2 | b3 | partial ]      h0 = H(None, b0), h1 = H(h0, b1), ...
    replica  {h0, h1, h3, ...}                    match = 2 blocks (h2 is missing)

A chained hash names the whole prefix before it, but evictions may leave a replica holding h3
without h2: the walk stops at the first miss, as the KV manager's own lookup does (full
attention needs the whole chain).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from pagedllm.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, hash_hex
from pagedllm.kv.prefix import make_block_hash


def request_block_hashes(token_ids: Sequence[int], block_size: int,
                         extra_keys: tuple | None = None) -> list[str]:
    """The chained hashes of the full blocks of ``token_ids``, as the replicas' KV events
    name them (``hash_hex`` of ``BlockHash.value``)."""
    out: list[str] = []
    parent = None
    for i in range(len(token_ids) // block_size):
        parent = make_block_hash(parent, token_ids[i * block_size:(i + 1) * block_size],
                                 extra_keys)
        out.append(hash_hex(parent.value))
    return out


def lookup_blocks(num_tokens: int, block_size: int) -> int:
    """How many leading full blocks a prompt of ``num_tokens`` can hit: at most
    ``num_tokens - 1`` tokens (the KV manager always computes the last prompt token)."""
    return max(num_tokens - 1, 0) // block_size


class ReplicaPrefixIndex:
    """One replica's cached hashes (from its KV events) and its soon-cached ones (the blocks of
    requests routed to it and not finished, counted per request)."""

    def __init__(self) -> None:
        self.cached: set[str] = set()
        self.pending: Counter[str] = Counter()

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.cached.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.cached.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.cached.clear()

    def match(self, hashes: Sequence[str], limit: int | None = None) -> int:
        """Leading blocks of ``hashes`` (at most ``limit``) cached or soon cached here."""
        n = len(hashes) if limit is None else min(limit, len(hashes))
        for i in range(n):
            h = hashes[i]
            if h not in self.cached and h not in self.pending:
                return i
        return n

    def add_pending(self, hashes: Iterable[str]) -> None:
        self.pending.update(hashes)

    def drop_pending(self, hashes: Iterable[str]) -> None:
        for h in hashes:
            left = self.pending[h] - 1
            if left > 0:
                self.pending[h] = left
            else:
                self.pending.pop(h, None)

    @property
    def size(self) -> int:
        """Blocks cached or soon cached (a new prefix goes where there is least)."""
        return len(self.cached) + len(self.pending)
