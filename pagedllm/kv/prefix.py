"""Prefix caching's pieces: the block hash chain, the lookup walk (``longest_cached_prefix``),
what a lookup returns (``PrefixHit``) and counts (``PrefixCacheStats``).
``KVCacheManager.find_prefix`` runs the walk; ``cache_blocks`` extends a request's chain.

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
from typing import NamedTuple

from pagedllm.kv.block_pool import BlockHash, BlockPool, KVBlock
from pagedllm.kv.window import SlidingWindow


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


def longest_cached_prefix(pool: BlockPool, token_ids: Sequence[int], block_size: int,
                          extra_keys: tuple | None, window: SlidingWindow | None) -> PrefixHit:
    """The longest hit over ``pool``'s index for ``token_ids`` (at most ``len - 1`` tokens: the
    last prompt token is always recomputed). Full attention needs the chain cached from its first
    block; with a sliding window only the blocks inside the window of the first token to compute
    (the blocks before may be evicted: ``num_skipped``)."""
    bs = block_size
    found: list[tuple[BlockHash, KVBlock | None]] = []
    parent: BlockHash | None = None
    for i in range(max(len(token_ids) - 1, 0) // bs):
        parent = make_block_hash(parent, token_ids[i * bs:(i + 1) * bs], extra_keys)
        found.append((parent, pool.get_cached_block(parent)))
        if found[-1][1] is None and window is None:
            break
    if window is None:
        n, skip = sum(1 for _, b in found if b is not None), 0
    else:
        n = window.longest_hit([b is not None for _, b in found])
        skip = window.first_needed_block(n * bs)
    held = found[skip:n]
    return PrefixHit([b.block_id for _, b in held if b is not None], n * bs,
                     tuple(h for h, _ in held), skip)


def held_blocks_of_hit(pool: BlockPool, prefix: PrefixHit, num_total_tokens: int,
                       block_size: int, window: SlidingWindow | None) -> list[KVBlock]:
    """The blocks a hit about to seed a table holds, checked: consistent counts, skipping only
    what the window allows, and still cached as found (a ValueError names what is wrong)."""
    positions = prefix.num_skipped + len(prefix.blocks)
    if prefix.num_tokens != positions * block_size:
        raise ValueError(f"prefix covers {positions} blocks but claims {prefix.num_tokens} tokens")
    if prefix.num_skipped and (window is None or prefix.num_skipped
                               > window.first_needed_block(prefix.num_tokens)):
        raise ValueError(f"prefix skips {prefix.num_skipped} blocks that the sliding window "
                         f"({None if window is None else window.window}) still needs")
    if num_total_tokens < prefix.num_tokens:
        raise ValueError(f"num_total_tokens={num_total_tokens} is below the prefix hit's "
                         f"{prefix.num_tokens} tokens")
    blocks = [pool.blocks[i] for i in prefix.blocks]
    for i, b in enumerate(blocks):
        if b.block_hash is None or (prefix.hashes and b.block_hash != prefix.hashes[i]):
            raise ValueError(f"stale prefix hit: block {b.block_id} was evicted after "
                             "find_prefix; call find_prefix again right before allocate_slots")
    return blocks
