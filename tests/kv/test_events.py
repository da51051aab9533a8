"""KV events (kv/events.py): the exact events of small scenarios, per-step batches and their
coalescing, plain data across a process boundary, no event built while nobody listens, and a
failing listener that cannot break the manager; and the engine's one batch per step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.kv.block_pool import hash_hex
from pagedllm.kv.events import (
    AllBlocksCleared,
    Allocated,
    BlockRemoved,
    BlockStored,
    Cached,
    Freed,
    KVCacheMirror,
    KVEventBatch,
)
from pagedllm.kv.manager import KVCacheManager, make_block_hash


def _hashes(tokens: list[int], bs: int) -> list[str]:
    out, parent = [], None
    for i in range(len(tokens) // bs):
        parent = make_block_hash(parent, tokens[i * bs:(i + 1) * bs], None)
        out.append(hash_hex(parent.value))
    return out


def test_stored_removed_cleared_exactly() -> None:
    kv = KVCacheManager(3, 4)
    seen: list[Any] = []
    kv.events.subscribe(seen.append)
    tokens = list(range(10))
    h0, h1 = _hashes(tokens, 4)
    assert kv.allocate_slots("a", 10)  # blocks 0, 1, 2
    kv.cache_blocks("a", tokens, 10)
    assert seen == [BlockStored([h0], None, [0, 1, 2, 3], 4, None, [0]),
                    BlockStored([h1], h0, [4, 5, 6, 7], 4, None, [1])]
    kv.free("a")  # queue: 2, 1, 0 (deepest first)
    seen.clear()
    assert kv.allocate_slots("b", 8)  # takes 2 (never cached), then evicts 1
    assert seen == [BlockRemoved([h1], [1])]
    kv.free("b")
    seen.clear()
    assert kv.reset_prefix_cache()
    assert seen == [AllBlocksCleared()]


def test_op_events_only_for_op_listeners() -> None:
    kv = KVCacheManager(4, 2)
    cache_only: list[Any] = []
    ops: list[Any] = []
    kv.events.subscribe(cache_only.append)
    kv.events.subscribe(ops.append, ops=True)
    assert kv.allocate_slots("a", 4)
    kv.cache_blocks("a", [1, 2, 3, 4], 4)
    kv.free("a")
    assert [type(e) for e in cache_only] == [BlockStored, BlockStored]
    assert [type(e) for e in ops] == [Allocated, BlockStored, BlockStored, Cached, Freed]
    assert ops[0] == Allocated("a", 4, [], True, [0, 1])
    assert ops[-1] == Freed("a", [0, 1], False)


def test_batches_per_step_coalesce_chains() -> None:
    kv = KVCacheManager(6, 2)
    each: list[Any] = []
    batches: list[KVEventBatch] = []
    kv.events.subscribe(each.append)
    unsubscribe = kv.events.subscribe_batches(batches.append)
    assert kv.allocate_slots("a", 6) and kv.allocate_slots("b", 4)
    kv.cache_blocks("a", [1, 2, 3, 4, 5, 6], 6)  # a chain of 3
    kv.cache_blocks("b", [9, 9, 8, 8], 4)  # a second chain: not merged into the first
    assert kv.events.end_step(ts=12.5) is batches[0] and len(batches) == 1
    a, b = _hashes([1, 2, 3, 4, 5, 6], 2), _hashes([9, 9, 8, 8], 2)
    assert batches[0] == KVEventBatch(12.5, [BlockStored(a, None, [1, 2, 3, 4, 5, 6], 2, None,
                                                         [0, 1, 2]),
                                             BlockStored(b, None, [9, 9, 8, 8], 2, None, [3, 4])])
    assert len(each) == 5 and each[0].block_hashes == a[:1]  # listeners' events left alone
    assert kv.events.end_step() is None and len(batches) == 1  # a step without cache events
    kv.free("a")
    kv.free("b")
    assert kv.allocate_slots("c", 12)  # evicts all five, deepest first: one BlockRemoved
    kv.events.end_step()
    assert batches[1].events == [BlockRemoved([*a[::-1], *b[::-1]], [2, 1, 0, 4, 3])]
    unsubscribe()
    assert kv.events.active  # ``each`` still listens
    kv.events.unsubscribe(each.append)
    assert not kv.events.active and not kv.events.ops


def test_events_are_plain_data_across_processes() -> None:
    kv = KVCacheManager(4, 2)
    batches: list[KVEventBatch] = []
    kv.events.subscribe_batches(batches.append)
    assert kv.allocate_slots("a", 4)
    kv.cache_blocks("a", [7, 7, 7, 7], 4)
    kv.free("a")
    assert kv.reset_prefix_cache()
    batch = kv.events.end_step()
    assert batch is not None and [type(e) for e in batch.events] == [BlockStored,
                                                                    AllBlocksCleared]
    wire = msgspec.msgpack.encode(batch)
    assert msgspec.msgpack.decode(wire, type=KVEventBatch) == batch
    assert msgspec.json.decode(msgspec.json.encode(batch), type=KVEventBatch) == batch


def test_nothing_is_built_while_nobody_listens() -> None:
    """No subscriber: no event object at all (publish never called), whatever the manager does."""
    kv = KVCacheManager(4, 2, num_host_blocks=4)

    def refuse(event: object) -> None:
        raise AssertionError(f"built {event} with nobody listening")

    kv.events.publish = refuse  # type: ignore[method-assign]
    tokens = [1, 2, 3, 4, 5]
    assert kv.allocate_slots("a", 5)
    kv.cache_blocks("a", tokens, 5)
    assert kv.swap_out("a") is not None and kv.swap_in("a") is not None
    kv.fork("a", "b", 5)
    assert kv.allocate_slots("b", 6)
    kv.take_block_copies()
    kv.free("a")
    kv.free("b")
    assert kv.allocate_slots("c", 8)  # evicts
    kv.free("c")
    kv.compact()
    kv.grow(2)
    assert kv.shrink(4) and kv.reset_prefix_cache()


def test_a_failing_listener_is_dropped_and_the_call_completes(
        caplog: pytest.LogCaptureFixture) -> None:
    kv = KVCacheManager(4, 2)
    mirror = KVCacheMirror(strict=True)
    kv.events.subscribe(mirror)

    def broken(event: object) -> None:
        raise RuntimeError("disk full")

    kv.events.subscribe(broken, ops=True)
    assert kv.allocate_slots("a", 4)
    kv.cache_blocks("a", [1, 2, 3, 4], 4)
    kv.check_integrity()
    assert kv.events.active and not kv.events.ops  # broken is gone, the mirror stays
    assert "disk full" in caplog.text and "unsubscribed" in caplog.text
    assert mirror.blocks == {hash_hex(v): b.block_id for v, b in kv.pool.cached.items()}


def test_engine_publishes_one_batch_per_step(tiny_models: dict[str, Path]) -> None:
    """Through LLM.generate: the step batches alone rebuild the pool's prefix-cache index."""
    llm = LLM(model=str(tiny_models["llama"]), block_size=4, num_kv_blocks=24, max_model_len=96)
    kv = llm.engine.kv
    mirror, batches = KVCacheMirror(strict=True), []
    kv.events.subscribe_batches(lambda b: (batches.append(b), mirror.apply(b)))
    system = list(range(5, 17))  # 3 shared blocks, then distinct tails
    prompts = [{"prompt_token_ids": system + [40 + i] * (3 + 5 * i)} for i in range(6)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                 use_tqdm=False)
    kinds = {type(e) for b in batches for e in b.events}
    assert kinds == {BlockStored, BlockRemoved}  # 24 blocks: the cache is evicted from too
    assert len(batches) <= llm.engine.scheduler.num_steps
    assert [b.ts for b in batches] == sorted(b.ts for b in batches)
    assert mirror.blocks.keys() == {hash_hex(v) for v in kv.pool.cached}


def test_a_late_mirror_follows_from_where_it_joined() -> None:
    """Subscribed after blocks were cached: removals of hashes it never saw are taken as they
    come (a strict mirror would be out of step and dropped), and it stays subscribed."""
    kv = KVCacheManager(3, 2)
    assert kv.allocate_slots("a", 4)
    kv.cache_blocks("a", [1, 2, 3, 4], 4)
    kv.free("a")
    late, strict = KVCacheMirror(), KVCacheMirror(strict=True)
    kv.events.subscribe(late)
    kv.events.subscribe(strict)
    assert kv.allocate_slots("b", 6)  # evicts both unseen hashes
    kv.cache_blocks("b", [5, 6, 7, 8, 9, 9], 6)
    assert late.blocks == {hash_hex(v): b.block_id for v, b in kv.pool.cached.items()}
    kv.events.unsubscribe(late)
    assert not kv.events.active  # the strict one was dropped at the first unseen removal
