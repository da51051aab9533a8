"""The KV tier at the scheduler (``kv/transfer.py``): two schedulers share one store as two
replicas would; a simulated KV (each slot holds the token it was computed for) shows that a
loaded block holds exactly what computing it would have written. No model."""

from __future__ import annotations

import torch

from pagedllm.config import SchedulerConfig
from pagedllm.kv.ext_tier import LRUBlockStore, payload_bytes
from pagedllm.kv.manager import KVCacheManager
from pagedllm.kv.transfer import KVTransfer
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams
from pagedllm.sched import Scheduler

BS = 4


class Replica:
    """A scheduler, its KV manager, and a fake KV: ``slots[block]`` = the token computed there."""

    def __init__(self, store: LRUBlockStore, fingerprint: str = "m", produces: bool = True,
                 consumes: bool = True, fits: bool = True) -> None:
        self.kv = KVCacheManager(32, BS, enable_prefix_caching=True)
        self.sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                               max_model_len=64), self.kv)
        self.slots: dict[int, list[int]] = {}
        self.t = KVTransfer(store, BS, fingerprint, produces=produces, consumes=consumes,
                            export=lambda blocks: [{"p0": torch.tensor(self.slots[b])} for b in blocks],
                            fits=lambda p: fits, size=payload_bytes)
        self.sched.external = self.t
        self.kv.events.subscribe(self.t.on_event)
        self.computed = 0  # prompt positions computed (not loaded, not hit)

    def run(self, rid: str, prompt: list[int], max_tokens: int = 2) -> Request:
        r = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                    max_model_len=64)
        self.sched.add_request(r)
        while not r.is_finished:
            out = self.sched.schedule()
            for payload, block in out.kv.loads:  # the runner's import, before the forward
                self.slots[block] = payload["p0"].tolist()
            for s in out.scheduled:  # the forward writes each new position's token
                table = self.kv.block_table(s.request.request_id)
                for pos in range(s.start, s.end):
                    self.slots.setdefault(table[pos // BS], [-1] * BS)[pos % BS] = \
                        s.request.token_ids[pos]
                self.computed += max(0, min(s.end, s.request.num_prompt_tokens) - s.start)
            self.sched.update(out, {s.request.request_id: 7 for s in out.scheduled if s.samples})
            self.t.flush()
            self._check_kv(r)
        return r

    def _check_kv(self, r: Request) -> None:
        if not self.kv.has_request(r.request_id):
            return
        table = self.kv.block_table(r.request_id)
        for pos in range(r.num_computed_tokens):
            assert self.slots[table[pos // BS]][pos % BS] == r.token_ids[pos], pos


PROMPT = list(range(100, 118))  # 18 tokens: 4 full blocks + 2


def test_a_replica_loads_what_another_computed() -> None:
    store = LRUBlockStore()
    a, b = Replica(store), Replica(store)
    a.run("a", PROMPT)
    assert a.computed == 18 and a.t.stats.blocks_stored >= 4
    r = b.run("b", PROMPT)
    assert r.num_cached_tokens == 16 and b.computed == 2  # 4 blocks loaded, 2 tokens computed
    s = b.t.stats
    assert (s.queries, s.hits, s.blocks_loaded) == (18, 16, 4)
    assert b.kv.stats.hits == 0  # the local prefix cache had nothing
    b.run("b2", PROMPT)  # now a local hit: the tier is asked for nothing past it
    assert b.t.stats.hits == 16 and b.kv.stats.hits == 16
    assert b.kv.num_free_blocks == b.kv.num_blocks  # every block came back


def test_tier_blocks_follow_a_local_hit_and_the_last_token_is_computed() -> None:
    store = LRUBlockStore()
    a, b = Replica(store), Replica(store)
    a.run("a", PROMPT)
    b.run("b0", PROMPT[:8] + [1, 2, 3])  # now b holds blocks 0-1 itself (from the tier)
    assert b.t.stats.hits == 8
    b.computed = 0
    r = b.run("b", PROMPT[:16])  # 16 tokens: blocks 0-1 local, block 2 from the tier, 3 computed
    assert b.kv.stats.hits == 8 and b.t.stats.hits == 8 + 4
    assert r.num_cached_tokens == 12 and b.computed == 4


def test_wrong_tokens_or_layout_or_model_are_never_loaded() -> None:
    store = LRUBlockStore()
    a = Replica(store)
    a.run("a", PROMPT)
    assert a.t.stats.blocks_stored >= 4
    # the same hash key, other tokens: the store verifies and refuses
    other = Replica(store)
    bad = dict(store._entries)
    for key, (toks, payload, size) in bad.items():
        store._entries[key] = ([t + 1 for t in toks], payload, size)
    other.run("x", PROMPT)
    assert other.t.stats.hits == 0 and other.computed == 18 and store.stats["rejected"] >= 1
    store._entries.update(bad)
    unfit = Replica(store, fits=False)  # a payload of another layout: recomputed
    unfit.run("y", PROMPT)
    assert unfit.t.stats.hits == 0 and unfit.t.stats.rejected == 1 and unfit.computed == 18
    foreign = Replica(store, fingerprint="another model")  # other keys altogether
    foreign.run("z", PROMPT)
    assert foreign.t.stats.hits == 0 and foreign.computed == 18


def test_roles() -> None:
    store = LRUBlockStore()
    consumer = Replica(store, produces=False)
    consumer.run("c", PROMPT)
    assert len(store) == 0  # a consumer puts nothing
    Replica(store).run("a", PROMPT)
    producer = Replica(store, consumes=False)
    producer.run("p", PROMPT)
    assert producer.t.stats.hits == 0 and producer.computed == 18
    consumer.kv.reset_prefix_cache()
    consumer.computed = 0
    consumer.run("c2", PROMPT)
    assert consumer.t.stats.hits == 16 and consumer.computed == 2


def test_a_full_pool_keeps_the_head_request_waiting_with_its_loads_for_later() -> None:
    store = LRUBlockStore()
    Replica(store).run("a", PROMPT)
    b = Replica(store)
    b.kv.allocate_slots("hog-blocks", 30 * BS)  # the pool is nearly full
    r = Request("b", list(PROMPT), SamplingParams(max_tokens=2, ignore_eos=True), max_model_len=64)
    b.sched.add_request(r)
    out = b.sched.schedule()
    assert not out.scheduled and not out.kv.loads and b.t.stats.queries == 0
    b.kv.free("hog-blocks")
    out = b.sched.schedule()
    assert len(out.kv.loads) == 4 and out.scheduled[0].num_new_tokens == 2
    assert b.t.stats.hits == 16
