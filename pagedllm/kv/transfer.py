"""The engine's side of the cluster-wide KV tier (``--kv-transfer-config``, issue #28 item 3).

    admission   local prefix hit: blocks 0..h-1     tier: blocks h..h+m-1 (verified)   compute the rest
                scheduler.lookup(req, hit) -> ExternalHit(m blocks)  ->  KVUpdate.loads (payload, block)
    every step  blocks that became cached (the KV manager's BlockStored events)  ->  put, batched

A replica that misses a prefix locally asks the tier for the next full blocks of the prompt, by
the same chained hash its prefix cache uses, and loads them into fresh blocks before the step's
forward instead of computing them (the last prompt token is always computed: its logits). The
tier returns only blocks whose stored token ids equal the prompt's (``LRUBlockStore.get``), and
the payloads are checked against this engine's KV planes (shape and dtype) before use, so a
block is used only once its tokens and layout are verified.

Keys are the chained hash mixed with the engine's fingerprint (model, KV dtypes, block size):
two models sharing one tier never read each other's blocks.

Counted as vLLM does: ``external_prefix_cache_queries`` (prompt tokens looked up in the tier)
and ``external_prefix_cache_hits`` (prompt tokens loaded from it), plus blocks and bytes moved
each way (``stats``). Pure Python: payloads are opaque to this module (the runner exports and
imports them, ``runner/kv_cache.py``).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedllm.kv.events import BlockStored
from pagedllm.kv.prefix import PrefixHit, make_block_hash

RECENT_PUTS = 4096  # keys this engine put lately: a block computed by many requests goes once


@dataclass
class ExternalHit:
    """Blocks found in the tier right after a request's local prefix hit: ``payloads`` for the
    table positions ``first`` .. ``first + len(payloads) - 1``."""

    first: int
    payloads: list[Any]
    block_size: int

    @property
    def num_tokens(self) -> int:
        return len(self.payloads) * self.block_size


@dataclass
class TransferStats:
    queries: int = 0  # prompt tokens looked up in the tier (requests admitted with it on)
    hits: int = 0  # prompt tokens loaded from it instead of computed
    blocks_loaded: int = 0
    blocks_stored: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0
    rejected: int = 0  # payloads found but refused: wrong layout for this engine's KV planes


class KVTransfer:
    """Looks up, loads and stores full KV blocks in a tier (``kv.ext_tier``: ``put``/``get``).

    ``export`` turns device block ids into payloads and ``fits`` checks one against this engine's
    planes (both the runner's, given by the engine); ``size`` counts a payload's bytes."""

    def __init__(self, tier: Any, block_size: int, fingerprint: str, *, produces: bool,
                 consumes: bool, export: Callable[[list[int]], list[Any]],
                 fits: Callable[[Any], bool], size: Callable[[Any], int]) -> None:
        self.tier, self.block_size = tier, block_size
        self.produces, self.consumes = produces, consumes
        self._salt = hashlib.blake2b(fingerprint.encode(), digest_size=16).digest()
        self._export, self._fits, self._size = export, fits, size
        self._pending: list[tuple[int, int, list[int]]] = []  # (block, hash value, tokens) to put
        self._recent: OrderedDict[int, None] = OrderedDict()
        self._head: tuple[str, int, ExternalHit | None] | None = None  # the last lookup
        self.stats = TransferStats()

    def key(self, value: int) -> int:
        """The tier's key of a block: its chained hash value under this engine's fingerprint."""
        d = hashlib.blake2b(self._salt + value.to_bytes(16, "little"), digest_size=16)
        return int.from_bytes(d.digest(), "little")

    # -- loading (the scheduler, at admission) --------------------------------------------------
    def lookup(self, request_id: str, token_ids: Sequence[int], extra_keys: tuple | None,
               hit: PrefixHit) -> ExternalHit | None:
        """The tier's verified blocks after ``hit`` (None if none). The answer is kept for the
        request until ``admitted`` or its local hit changes: the head of the queue retries each
        step while the pool is full, and asks the tier once. Only the last request looked up is
        kept, so waiting requests hold no payloads."""
        if not self.consumes or hit.num_skipped:
            return None
        if self._head is not None and self._head[:2] == (request_id, hit.num_tokens):
            return self._head[2]
        bs = self.block_size
        first = len(hit.blocks)
        last = (len(token_ids) - 1) // bs  # the last prompt token is always computed
        if first >= last:
            return None
        parent = hit.hashes[-1] if hit.hashes else None
        hashes, tokens = [], []
        for i in range(first, last):
            parent = make_block_hash(parent, token_ids[i * bs:(i + 1) * bs], extra_keys)
            hashes.append(self.key(parent.value))
            tokens.append(list(parent.token_ids))
        payloads = []
        for p in self.tier.get(hashes, tokens):
            if not self._fits(p):
                self.stats.rejected += 1
                break
            payloads.append(p)
        found = ExternalHit(first, payloads, bs) if payloads else None
        self._head = (request_id, hit.num_tokens, found)
        return found

    def admitted(self, request_id: str, num_prompt_tokens: int, found: ExternalHit | None,
                 table: list[int]) -> list[tuple[Any, int]]:
        """The request looked up was admitted with block table ``table``: the (payload, device
        block) loads for the step's ``KVUpdate``."""
        self.stats.queries += num_prompt_tokens
        if self._head is not None and self._head[0] == request_id:
            self._head = None
        if found is None:
            return []
        self.stats.hits += found.num_tokens
        self.stats.blocks_loaded += len(found.payloads)
        self.stats.bytes_loaded += sum(map(self._size, found.payloads))
        return list(zip(found.payloads, table[found.first:found.first + len(found.payloads)],
                        strict=True))

    # -- storing (the KV manager's new cached blocks, put after the step) ------------------------
    def on_event(self, event: object) -> None:
        """A cache-event listener (``KVCacheManager.events.subscribe``): the blocks a
        ``BlockStored`` names became full, computed and indexed; put them after the step."""
        if self.produces and isinstance(event, BlockStored):
            bs = event.block_size
            for j, (hx, block) in enumerate(zip(event.block_hashes, event.block_ids, strict=True)):
                self._pending.append((block, int(hx, 16), event.token_ids[j * bs:(j + 1) * bs]))

    def flush(self) -> None:
        """Put the blocks cached this step (after the forward wrote them; before the next step
        can reuse a freed one): one export for all, each key once."""
        pending, self._pending = self._pending, []
        todo: dict[int, tuple[int, list[int]]] = {}
        for block, value, tokens in pending:
            k = self.key(value)
            if k not in self._recent and k not in todo:
                todo[k] = (block, tokens)
        if not todo:
            return
        payloads = self._export([b for b, _ in todo.values()])
        for (k, (_, tokens)), p in zip(todo.items(), payloads, strict=True):
            self.tier.put(k, tokens, p)
            self._recent[k] = None
            self.stats.blocks_stored += 1
            self.stats.bytes_stored += self._size(p)
        while len(self._recent) > RECENT_PUTS:
            self._recent.popitem(last=False)
        self.tier.sync()  # visible to the other replicas from now on

    def forget(self) -> None:
        """Drop what is pending (the engine's KV was reset or reshaped under it)."""
        self._pending.clear()
        self._head = None
