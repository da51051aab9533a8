"""The router's pure parts: a request's block hashes are the KV manager's own (the ones its
events publish), the prefix index rebuilt from KV event batches matches exactly what the KV
manager's lookup finds, and the policies' choices (round robin, least load, cache affinity
against an imbalance threshold, "soon cached" requests landing together, dead replicas)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.kv.events import BlockStored, KVEventBatch
from pagedllm.kv.manager import KVCacheManager
from pagedllm.router.aggregate import merge_kv_stats, merge_stats
from pagedllm.router.policy import (
    CacheAware,
    LeastLoad,
    ReplicaLoad,
    RoundRobin,
    make_policy,
)
from pagedllm.router.prefix_index import (
    ReplicaPrefixIndex,
    lookup_blocks,
    request_block_hashes,
)
from pagedllm.sched.stats import KVBlockCounts, StepStats


def _stored(kv: KVCacheManager, rid: str, tokens: list[int],
            extra: tuple | None = None) -> list[str]:
    """Admit and compute a whole request; the hashes its BlockStored events name, in order."""
    seen: list[Any] = []
    unsubscribe = kv.events.subscribe(seen.append)
    assert kv.allocate_slots(rid, len(tokens))
    kv.cache_blocks(rid, tokens, len(tokens), extra)
    unsubscribe()
    return [h for e in seen if isinstance(e, BlockStored) for h in e.block_hashes]


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 50_000), max_size=70), bs=st.sampled_from([1, 2, 4, 16]),
       lora=st.sampled_from([None, ("lora", 7)]))
def test_request_hashes_are_the_ones_the_kv_manager_publishes(tokens: list[int], bs: int,
                                                              lora: tuple | None) -> None:
    kv = KVCacheManager(80, bs)
    assert request_block_hashes(tokens, bs, lora) == _stored(kv, "a", tokens, lora)
    assert lookup_blocks(len(tokens), bs) == max(len(tokens) - 1, 0) // bs


def test_a_different_adapter_or_token_changes_every_later_hash() -> None:
    a = request_block_hashes([1, 2, 3, 4, 5, 6], 2)
    b = request_block_hashes([1, 2, 9, 4, 5, 6], 2)
    c = request_block_hashes([1, 2, 3, 4, 5, 6], 2, ("lora", 1))
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]  # chained: the change carries on
    assert not set(a) & set(c)


PROMPTS = [[0, 0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 0, 0, 1, 1, 3, 3], [0, 0, 0, 0, 5, 5, 5, 5, 5, 5],
           [7, 7, 7, 7, 0, 0, 0, 0], [0, 0, 0, 0]]


@settings(max_examples=80, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, len(PROMPTS) - 1)), max_size=40),
       num_blocks=st.integers(3, 9))
def test_the_index_from_event_batches_finds_what_the_kv_manager_finds(
        ops: list[tuple[bool, int]], num_blocks: int) -> None:
    """Admit / finish requests of overlapping prompts on a small pool (evictions happen); after
    every step the index rebuilt from the step batches alone matches, for every prompt, exactly
    the prefix ``find_prefix`` hits."""
    bs = 2
    kv = KVCacheManager(num_blocks, bs)
    index = ReplicaPrefixIndex()
    kv.events.subscribe_batches(index.apply)
    running: list[str] = []
    for n, (admit, p) in enumerate(ops):
        if admit or not running:
            tokens = PROMPTS[p]
            hit = kv.find_prefix(tokens)
            if kv.allocate_slots(f"r{n}", len(tokens), hit):
                kv.cache_blocks(f"r{n}", tokens, len(tokens))
                running.append(f"r{n}")
        else:
            kv.free(running.pop(p % len(running)))
        kv.events.end_step()
        for tokens in PROMPTS:
            want = kv.find_prefix(tokens, record_stats=False).num_tokens
            got = index.match(request_block_hashes(tokens, bs), lookup_blocks(len(tokens), bs))
            assert got * bs == want, (tokens, got, want)


def test_pending_hashes_count_per_request() -> None:
    idx = ReplicaPrefixIndex()
    h = request_block_hashes(list(range(8)), 2)
    idx.add_pending(h)
    idx.add_pending(h[:2])
    assert idx.match(h) == 4 and idx.size == 4
    idx.drop_pending(h)
    assert idx.match(h) == 2 and idx.size == 2
    idx.drop_pending(h[:2])
    assert idx.match(h) == 0 and idx.size == 0 and not idx.pending
    idx.apply(KVEventBatch(0.0, [BlockStored(h[:3], None, list(range(6)), 2)]))
    assert idx.match(h) == 3 and idx.match(h, limit=2) == 2


def _loads(*counts: int, usage: tuple[float, ...] | None = None) -> list[ReplicaLoad]:
    return [ReplicaLoad(i, c, 0.0 if usage is None else usage[i]) for i, c in enumerate(counts)]


def test_round_robin_takes_turns_over_the_live_replicas() -> None:
    rr = RoundRobin()
    assert [rr.choose([], 0, _loads(5, 0, 0)).replica for _ in range(4)] == [0, 1, 2, 0]
    live = [ReplicaLoad(0, 0), ReplicaLoad(2, 0)]  # replica 1 died
    assert [rr.choose([], 0, live).replica for _ in range(3)] == [2, 0, 2]


def test_least_load_counts_requests_then_kv_usage_then_takes_turns() -> None:
    ll = LeastLoad()
    assert ll.choose([], 0, _loads(3, 1, 2)).replica == 1
    assert ll.choose([], 0, _loads(1, 1, 2, usage=(0.5, 0.2, 0.0))).replica == 1
    assert [ll.choose([], 0, _loads(0, 0)).replica for _ in range(3)] == [0, 1, 0]
    with pytest.raises(ValueError, match="no live replica"):
        ll.choose([], 0, [])


def _route(policy: CacheAware, tokens: list[int], loads: list[ReplicaLoad], bs: int = 4) -> int:
    h = request_block_hashes(tokens, bs)
    d = policy.choose(h, lookup_blocks(len(tokens), bs), loads)
    policy.routed(d.replica, h)
    return d.replica


SYSTEM_A, SYSTEM_B = list(range(100, 116)), list(range(200, 216))  # 4 blocks of 4 each


def test_cache_aware_sends_a_new_shared_prefix_to_one_replica_soon_cached() -> None:
    """Concurrent requests with new system prompts: the first of each goes where the load is
    least, the rest follow it before any KV event came back (routed = soon cached)."""
    ca = CacheAware(imbalance_threshold=8)
    counts = [0, 0]
    order = []
    for user, system in enumerate([SYSTEM_A, SYSTEM_B, SYSTEM_B, SYSTEM_A] * 2):
        r = _route(ca, system + [user] * 5, _loads(*counts))
        counts[r] += 1
        order.append(r)
    assert order == [0, 1, 1, 0] * 2  # taking turns would give [0, 1, 0, 1] * 2


def test_cache_aware_follows_the_kv_events_and_forgets_finished_requests() -> None:
    ca = CacheAware()
    hb = request_block_hashes(SYSTEM_B, 4)
    ca.on_kv_events(1, KVEventBatch(0.0, [BlockStored(hb, None, SYSTEM_B, 4)]))
    d = ca.choose(request_block_hashes(SYSTEM_B + [1, 2], 4), 4, _loads(0, 3))
    assert d == (1, 4, "cache")
    ha = request_block_hashes(SYSTEM_A + [9], 4)
    ca.routed(0, ha)
    assert ca.choose(ha, 4, _loads(0, 0)).why == "cache"
    ca.finished(0, ha)  # finished without its blocks reported cached (e.g. evicted at once)
    assert ca.choose(ha, 4, _loads(0, 0)).why == "load"
    ca.remove(1)  # replica 1 died: what it had cached is gone with it
    assert ca.choose(request_block_hashes(SYSTEM_B, 4), 3, _loads(0, 0)).matched_blocks == 0


def test_cache_aware_balances_past_the_threshold() -> None:
    ca = CacheAware(imbalance_threshold=2)
    h = request_block_hashes(SYSTEM_A, 4)
    ca.routed(0, h)
    assert ca.choose(h, 3, _loads(2, 0)).replica == 0  # within the threshold: affinity
    d = ca.choose(h, 3, _loads(3, 0))
    assert d.replica == 1 and d.why == "balance"


def test_a_new_prefix_goes_where_least_is_cached() -> None:
    ca = CacheAware()
    ca.routed(0, request_block_hashes(SYSTEM_A, 4))
    assert ca.choose(request_block_hashes(SYSTEM_B, 4), 3, _loads(1, 1)).replica == 1


@settings(max_examples=200, deadline=None)
@given(counts=st.lists(st.integers(0, 30), min_size=1, max_size=5),
       cached=st.lists(st.integers(0, 4), min_size=5, max_size=5),
       dead=st.sets(st.integers(0, 4), max_size=4), threshold=st.integers(0, 10))
def test_cache_aware_choices(counts: list[int], cached: list[int], dead: set[int],
                             threshold: int) -> None:
    """Whatever the loads and caches: a live replica; the least loaded one when the loads are
    out of balance; else one with the longest match, the least loaded among those."""
    ca = CacheAware(threshold)
    h = request_block_hashes(SYSTEM_A, 4)
    for i, n in enumerate(cached):
        ca.on_kv_events(i, KVEventBatch(0.0, [BlockStored(h[:n], None, SYSTEM_A[:4 * n], 4)]))
    live = [ReplicaLoad(i, c) for i, c in enumerate(counts) if i not in dead]
    if not live:
        return
    d = ca.choose(h, 3, live)
    by = {r.replica: r for r in live}
    assert d.replica in by
    loads = [r.num_requests for r in live]
    if max(loads) - min(loads) > threshold:
        assert by[d.replica].num_requests == min(loads) and d.why == "balance"
    else:
        best = max(min(cached[r.replica], 3) for r in live)
        assert d.matched_blocks == min(cached[d.replica], 3) == best
        assert by[d.replica].num_requests == min(r.num_requests for r in live
                                                 if min(cached[r.replica], 3) == best)


def test_make_policy_names() -> None:
    assert [make_policy(n).name for n in ("round_robin", "least_load", "cache_aware")] == [
        "round_robin", "least_load", "cache_aware"]
    with pytest.raises(ValueError, match="--routing-policy 'random'"):
        make_policy("random")


def test_totals_over_replicas() -> None:
    a = StepStats(num_running=2, num_waiting=1, prefix_cache_queries=10, prefix_cache_hits=4,
                  kv=KVBlockCounts(total=8, free=5), preemptions_by_kind={"recompute": 1})
    b = StepStats(num_running=1, prefix_cache_queries=6, prefix_cache_hits=6,
                  kv=KVBlockCounts(total=8, free=8), preemptions_by_kind={"recompute": 2})
    m = merge_stats([a, b])
    assert (m.num_running, m.num_waiting, m.kv.total, m.kv.used) == (3, 1, 16, 3)
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (16, 10)
    assert m.preemptions_by_kind == {"recompute": 3}
    one = {"num_blocks": 8, "used_blocks": 3, "prefix_cache_queries": 10, "prefix_cache_hits": 4,
           "max_blocks_per_request": 2, "kv_utilization": 0.5, "preemptions_by_kind": {},
           "spec_decode_num_drafts": 0, "spec_decode_num_draft_tokens": 0,
           "spec_decode_num_accepted_tokens": 0}
    one |= {k: 0 for k in ("cached_blocks", "free_blocks", "shared_blocks", "pinned_blocks",
                           "lora_blocks", "lora_resident_adapters", "lora_page_ins", "lora_page_outs",
                           "window_freed_blocks", "num_preemptions", "swapped_out_blocks",
                           "swapped_in_blocks", "num_swapped", "kv_tier_blocks_loaded",
                           "kv_tier_blocks_stored", "kv_tier_bytes_loaded",
                           "kv_tier_bytes_stored", "external_prefix_cache_queries")}
    one["external_prefix_cache_hits"] = 32
    two = one | {"prefix_cache_queries": 6, "prefix_cache_hits": 6, "max_blocks_per_request": 5}
    s = merge_kv_stats([one, None, two])
    assert (s["num_blocks"], s["prefix_cache_hits"], s["max_blocks_per_request"]) == (16, 10, 5)
    assert s["external_prefix_cache_hits"] == 64
    assert s["prefix_cache_hit_rate"] == 10 / 16 and s["replicas"] == [one, None, two]
