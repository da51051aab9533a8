"""KV events: what the block pool and the KV manager did, published to whoever subscribes.

The one observer API on the KV manager (``KVCacheManager.events``, a ``KVEventBus``): the JSONL
trace (kv/trace.py), the ZMQ publisher (kv/publisher.py), the KV inspector and the router
subscribe; nothing wraps or patches the manager. Two families of plain-data events (msgspec
Structs: they cross a process boundary as msgpack or JSON):

- **cache events**, in vLLM's KV-events shape (``vllm/distributed/kv_events.py``): the set of
  prefix-cached blocks changed. ``BlockStored`` (a run of chained hashes became cached; its
  parent hash, the tokens, the block size), ``BlockRemoved`` (hashes evicted from the prefix cache
  because their blocks were reused or dropped), ``AllBlocksCleared`` (``reset_prefix_cache``).
  Replaying them reproduces ``BlockPool.cached`` exactly (tests/kv/test_properties.py). Hashes
  are the 128-bit ``BlockHash.value`` as 32 hex digits (``hash_hex``): msgpack ints stop at 64
  bits. ``block_ids`` (our addition) say where each block lives; compaction moves blocks without
  a cache event (the set of hashes is unchanged), see ``Compacted``.
- **op events**: one per public mutating call of the manager, with what it did (blocks handed
  out, pairs to copy...): enough to re-execute it (the trace's replay). Each is tagged with the
  trace's ``op`` name and its fields are the trace line's keys.

Cost: the manager builds an event only while somebody listens (``bus.active`` for cache events,
``bus.ops`` for op events: one attribute test on the hot path otherwise). Listeners are called
synchronously, in order, inside the call that caused the event (the effects of an op come before
the op's own event); they must not call back into the manager. A listener that raises is logged
and unsubscribed: an observer never breaks the call it observes (the pool stays whole).
``end_step()`` (``KVMemoryPolicy.end_step`` calls it at the end of every engine step) hands the
step's cache events, coalesced, to batch listeners as one ``KVEventBatch`` with a timestamp,
vLLM's unit of publication.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, Union

import msgspec

from pagedllm.logging_utils import init_logger

logger = init_logger(__name__)
# -- cache events (vLLM's shape; array_like: compact on the wire, as vLLM encodes them) ----------


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """A change of the set of prefix-cached blocks."""


class BlockStored(KVCacheEvent):
    """Full blocks became cached: ``block_hashes`` is a chain (each the parent of the next, the
    first's parent ``parent_block_hash``, None at a prompt's start), ``token_ids`` their tokens
    (``block_size`` per block), held in ``block_ids``."""

    block_hashes: list[str]
    parent_block_hash: str | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    block_ids: list[int] = []


class BlockRemoved(KVCacheEvent):
    """Cached blocks were evicted: their hashes no longer hit (their blocks are being reused)."""

    block_hashes: list[str]
    block_ids: list[int] = []


class AllBlocksCleared(KVCacheEvent):
    """Every cached hash was dropped (``reset_prefix_cache``)."""


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The cache events of one engine step, in order; ``ts`` is wall-clock seconds (time.time)."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


CacheEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]  # noqa: UP007 - a runtime value


# -- op events: one per public mutating call of KVCacheManager (the trace's ops and effects) -------


class KVOpEvent(msgspec.Struct, omit_defaults=True, tag_field="op"):
    """What one manager call did. Block lists are by table position; None marks a position freed
    behind the sliding window."""


class PrefixHitTaken(KVOpEvent, tag="prefix_hit"):
    """Effect of an allocate that seeded a new table with cached blocks."""

    rid: str
    blocks: list[int]
    hashes: list[str]


class CowCopied(KVOpEvent, tag="cow_copy"):
    """Effect of an allocate: a still-shared partial block was replaced by a private copy."""

    rid: str
    src: int
    dst: int


class Allocated(KVOpEvent, tag="allocate"):
    rid: str
    num_tokens: int
    prefix: list[int]
    ok: bool
    new: list[int]
    skipped: int = 0


class Cached(KVOpEvent, tag="cache"):
    """Blocks ``start`` .. of the request were hashed (``tokens`` are theirs)."""

    rid: str
    start: int
    tokens: list[int]
    blocks: list[int | None]
    hashes: list[str]
    extra_keys: list[Any] | None = None


class WindowFreed(KVOpEvent, tag="free_window"):
    rid: str
    num_computed: int
    blocks: list[int]


class Freed(KVOpEvent, tag="free"):
    rid: str
    blocks: list[int | None]
    swapped: bool


class Forked(KVOpEvent, tag="fork"):
    parent: str
    child: str
    num_tokens: int
    blocks: list[int | None]


class CopiesTaken(KVOpEvent, tag="take_copies"):
    copies: list[list[int]]


class SwappedOut(KVOpEvent, tag="swap_out"):
    """``pairs``: (device, host) copies, None when refused."""

    rid: str
    pairs: list[list[int]] | None


class SwappedIn(KVOpEvent, tag="swap_in"):
    """``pairs``: (host, device) copies, None when refused."""

    rid: str
    pairs: list[list[int]] | None


class Compacted(KVOpEvent, tag="compact"):
    """(src, dst) moves: each block's references and cached hash moved from src to dst."""

    moves: list[list[int]]


class Grown(KVOpEvent, tag="grow"):
    n: int


class Shrunk(KVOpEvent, tag="shrink"):
    n: int
    ok: bool


class PrefixCacheReset(KVOpEvent, tag="reset_prefix_cache"):
    ok: bool


class RolledBack(KVOpEvent, tag="rollback"):
    rid: str
    num_tokens: int
    blocks: list[int]


KVEvent = Union[CacheEvent, KVOpEvent]  # noqa: UP007 - a runtime value
Listener = Callable[[Any], None]


def hash_hex(value: int) -> str:
    """A ``BlockHash.value`` as 32 hex digits: how events (and the KV trace) carry hashes."""
    return f"{value:032x}"


def pairs(items: Sequence[tuple[int, int]] | None) -> list[list[int]] | None:
    """(a, b) pairs as lists, how events carry them (None stays None)."""
    return None if items is None else [list(p) for p in items]


class _Block(Protocol):
    block_id: int

    @property
    def block_hash(self) -> Any: ...


def publish_allocate(bus: KVEventBus, request_id: str, num_tokens: int, hit: Sequence[_Block],
                     skipped: int, new: Sequence[_Block] | None,
                     copies: Sequence[tuple[int, int]] = ()) -> None:
    """An ``allocate_slots`` (``new``: the blocks it appended; None: refused), after its effects
    when it succeeded: the prefix hit ``hit`` that seeded a new table, copy-on-write copies."""
    hit_ids = [b.block_id for b in hit]
    if new is not None:
        if hit_ids:
            bus.publish(PrefixHitTaken(request_id, hit_ids, [hash_hex(b.block_hash.value)
                                                             for b in hit]))
        for src, dst in copies:
            bus.publish(CowCopied(request_id, src, dst))
    bus.publish(Allocated(request_id, num_tokens, hit_ids, new is not None,
                          [] if new is None else [b.block_id for b in new], skipped))


class _Batcher:
    """Collects a step's cache events for batch listeners, merging a ``BlockStored`` that
    continues the previous one's chain into it, and consecutive ``BlockRemoved`` (order between
    kinds is kept). Merged events are its own copies: synchronous listeners saw the originals."""

    def __init__(self) -> None:
        self.events: list[CacheEvent] = []
        self._own = False  # events[-1] is a copy of ours (its lists may be extended in place)

    def __call__(self, event: KVEvent) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(event, BlockStored) and isinstance(last, BlockStored) and (
                last.block_hashes[-1] == event.parent_block_hash
                and last.block_size == event.block_size and last.lora_id == event.lora_id):
            last = self._mine(last)
            last.block_hashes += event.block_hashes
            last.token_ids += event.token_ids
            last.block_ids += event.block_ids
        elif isinstance(event, BlockRemoved) and isinstance(last, BlockRemoved):
            last = self._mine(last)
            last.block_hashes += event.block_hashes
            last.block_ids += event.block_ids
        elif isinstance(event, (BlockStored, BlockRemoved, AllBlocksCleared)):
            self.events.append(event)
            self._own = False

    def _mine(self, last: Any) -> Any:
        if not self._own:
            last = self.events[-1] = msgspec.structs.replace(
                last, **{f: list(getattr(last, f)) for f in last.__struct_fields__
                         if isinstance(getattr(last, f), list)})
            self._own = True
        return last

    def take(self) -> list[CacheEvent]:
        events, self.events, self._own = self.events, [], False
        return events


class KVEventBus:
    """Listeners of one KV manager (and its pool). ``subscribe`` / ``unsubscribe`` callbacks:

    - ``subscribe(cb)``: ``cb(event)`` for each cache event, as it happens;
    - ``subscribe(cb, ops=True)``: also each op event (the trace);
    - ``subscribe_batches(cb)``: ``cb(KVEventBatch)`` once per step that changed the cache.

    ``active`` / ``ops`` are plain attributes the publishers test before building an event."""

    def __init__(self) -> None:
        # tuples, rebuilt on (un)subscribe: a listener dropped while publishing is safe
        self._listeners: tuple[Listener, ...] = ()
        self._op_listeners: tuple[Listener, ...] = ()
        self._batch_listeners: tuple[Callable[[KVEventBatch], None], ...] = ()
        self._batcher: _Batcher | None = None
        self.active = False  # somebody listens: build cache events
        self.ops = False  # somebody listens to op events: build them too
        self.data_parallel_rank: int | None = None  # stamped on batches (a replica's rank)

    def subscribe(self, callback: Listener, ops: bool = False) -> Callable[[], None]:
        """Call ``callback(event)`` for every cache event (and op event if ``ops``) from now
        on; returns a function that unsubscribes it."""
        if ops:
            self._op_listeners += (callback,)
        else:
            self._listeners += (callback,)
        self._update()
        return lambda: self.unsubscribe(callback)

    def subscribe_batches(self, callback: Callable[[KVEventBatch], None]) -> Callable[[], None]:
        """Call ``callback(batch)`` at each ``end_step`` that has cache events; returns a
        function that unsubscribes it."""
        self._batch_listeners += (callback,)
        if self._batcher is None:
            self._batcher = _Batcher()
            self._listeners += (self._batcher,)
        self._update()
        return lambda: self.unsubscribe(callback)

    def unsubscribe(self, callback: Callable[..., None]) -> None:
        """Stop calling ``callback`` (every subscription of it; compared by ``==``, so a bound
        method read again matches). Unknown callbacks: no-op."""
        self._listeners = tuple(c for c in self._listeners if c != callback)
        self._op_listeners = tuple(c for c in self._op_listeners if c != callback)
        self._batch_listeners = tuple(c for c in self._batch_listeners if c != callback)
        if not self._batch_listeners and self._batcher is not None:
            self._listeners = tuple(c for c in self._listeners if c is not self._batcher)
            self._batcher = None
        self._update()

    def _update(self) -> None:
        self.ops = bool(self._op_listeners)
        self.active = bool(self._listeners) or self.ops

    def publish(self, event: KVEvent) -> None:
        """Deliver ``event`` (callers test ``active`` / ``ops`` first, so building it is free
        when nobody listens). Op events reach op listeners only."""
        if not isinstance(event, KVOpEvent):
            for cb in self._listeners:
                self._call(cb, event)
        for cb in self._op_listeners:
            self._call(cb, event)

    def _call(self, cb: Callable[[Any], None], event: KVEvent | KVEventBatch) -> None:
        try:
            cb(event)
        except Exception:  # noqa: BLE001 - the manager's call must complete whatever cb does
            logger.exception("KV event listener %r failed on %r; unsubscribed it", cb, event)
            self.unsubscribe(cb)

    def end_step(self, ts: float | None = None) -> KVEventBatch | None:
        """Close the step: its cache events (if any) go to the batch listeners as one batch,
        which is also returned. Without batch listeners nothing was collected: None."""
        if self._batcher is None or not self._batcher.events:
            return None
        batch = KVEventBatch(time.time() if ts is None else ts, self._batcher.take(),
                             self.data_parallel_rank)
        for cb in self._batch_listeners:
            self._call(cb, batch)
        return batch


class KVCacheMirror:
    """A subscriber's view of the prefix cache rebuilt from the events: hash -> block id. The
    hashes follow from cache events alone (what a router in another process keeps); the block
    ids stay exact only with op events too (``subscribe(mirror, ops=True)``: ``Compacted``
    moves blocks without a cache event). The tests compare it with the pool's index.

    ``strict``: a hash stored twice or removed unseen raises ValueError (the stream is out of
    step with the mirror: the tests); otherwise it is taken as is (a mirror that joined a
    running engine late)."""

    def __init__(self, strict: bool = False) -> None:
        self.blocks: dict[str, int] = {}
        self.strict = strict

    def __call__(self, event: KVEvent) -> None:
        """Apply one event."""
        if isinstance(event, BlockStored):
            for h, b in zip(event.block_hashes, event.block_ids, strict=True):
                if self.strict and h in self.blocks:
                    raise ValueError(f"block hash {h} stored twice")
                self.blocks[h] = b
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                if self.blocks.pop(h, None) is None and self.strict:
                    raise ValueError(f"block hash {h} removed but not cached")
        elif isinstance(event, AllBlocksCleared):
            self.blocks.clear()
        elif isinstance(event, Compacted):
            moved = {src: dst for src, dst in event.moves}
            self.blocks = {h: moved.get(b, b) for h, b in self.blocks.items()}

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            self(event)
