"""Random admit / step / preempt / finish sequences against KVCacheManager (hypothesis).

Besides ``check_integrity()`` after every step, the machine keeps a shadow of the physical KV
memory: ``shadow[block_id]`` is the token prefix whose KV was last written into that block. A
prefix hit must land on blocks whose shadow equals the new prompt's prefix (identical content),
and a request may only ever write into blocks that no other request holds.

Some machines run a sliding-window manager: after each chunk the blocks that left the window are
freed (as the scheduler does), so a request holds exactly the blocks from its window on, and a
prefix hit holds the window of its first uncomputed token.

Most machines also listen to the KV events (kv/events.py) and rebuild the prefix cache from them
alone, three ways (each event as it comes, ops included: hash -> block id through compactions;
cache events only: the set of hashes; per-step batches, coalesced: the set of hashes): after every
step each equals the pool's index exactly, and every stored block's tokens are its shadow's last
``block_size`` tokens.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from pagedllm.kv.block_pool import hash_hex
from pagedllm.kv.events import BlockStored, KVCacheMirror, KVEvent
from pagedllm.kv.manager import KVCacheManager

TOKENS = st.lists(st.integers(0, 1), min_size=1, max_size=12)  # tiny alphabet: prefixes collide


class KVMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(1, 12),
                caching=st.booleans(), window=st.sampled_from([None, None, 1, 2, 3, 6]),
                listen=st.sampled_from([True, True, False]))
    def setup(self, block_size: int, num_blocks: int, caching: bool, window: int | None,
              listen: bool) -> None:
        self.m = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching,
                                sliding_window=window)
        self.mirrors: tuple[KVCacheMirror, KVCacheMirror, KVCacheMirror] | None = None
        self.event_errors: list[str] = []
        if listen:
            self.mirrors = (KVCacheMirror(strict=True), KVCacheMirror(strict=True),
                            KVCacheMirror(strict=True))
            self.m.events.subscribe(self.mirrors[0], ops=True)
            self.m.events.subscribe(self.mirrors[1])
            self.m.events.subscribe_batches(self.mirrors[2].apply)
            self.m.events.subscribe(self.check_stored)
        self.bs = block_size
        self.tokens: dict[str, list[int]] = {}  # running requests
        self.computed: dict[str, int] = {}
        self.preempted: dict[str, list[int]] = {}
        self.shadow: dict[int, tuple[int, ...]] = {}
        self.next_id = 0

    # -- helpers ------------------------------------------------------------------------------
    def check_stored(self, event: KVEvent) -> None:
        """A listener: a stored block holds the tokens its event names (the shadow's tail)."""
        if isinstance(event, BlockStored):
            bs = event.block_size
            for i, b in enumerate(event.block_ids):
                if self.shadow.get(b, ())[-bs:] != tuple(event.token_ids[i * bs:(i + 1) * bs]):
                    self.event_errors.append(f"block {b} stored as {event} holds "
                                             f"{self.shadow.get(b)}")

    def snapshot(self) -> tuple:
        m = self.m
        return (m.pool.free_queue.ids(), [b.ref_cnt for b in m.pool.blocks],
                [b.block_hash for b in m.pool.blocks], dict(m.pool.cached),
                {r: m.block_table(r) for r in self.tokens})

    def try_allocate(self, rid: str, total: int, prefix=None) -> bool:
        before = self.snapshot()
        free = self.m.num_free_blocks
        needed = self.m.num_blocks_needed(rid, total, prefix)
        old = self.m.block_table(rid) if self.m.has_request(rid) else []
        ok = self.m.allocate_slots(rid, total, prefix)
        assert ok == (needed <= free)
        if not ok:
            assert self.snapshot() == before, "a failed allocate_slots changed state"
            return False
        table = self.m.block_table(rid)
        assert len(table) >= -(-total // self.bs) and table[:len(old)] == old
        assert self.m.num_free_blocks == free - needed
        hit_ids = prefix.blocks if prefix is not None else []
        skipped = prefix.num_skipped if prefix is not None and not old else 0
        for b in table[len(old) + skipped + len(hit_ids):]:
            assert self.m.pool.blocks[b].ref_cnt == 1, f"fresh block {b} is shared"
        return True

    def compute(self, rid: str, end: int) -> None:
        """Write KV for tokens [computed, end) of rid, hash newly full blocks, free the blocks
        that left the window."""
        tokens, start, table = self.tokens[rid], self.computed[rid], self.m.block_table(rid)
        assert start // self.bs >= self.m.num_skipped_blocks(rid), "writes into a freed block"
        for j in range(start // self.bs, -(-end // self.bs)):
            block = table[j]
            assert self.m.pool.blocks[block].ref_cnt == 1, f"{rid} writes into shared block {block}"
            self.shadow[block] = tuple(tokens[:min((j + 1) * self.bs, end)])
        self.computed[rid] = end
        self.m.cache_blocks(rid, tokens, end)
        self.m.free_outside_window(rid, end)
        if self.m.window is not None:
            assert self.m.num_skipped_blocks(rid) == self.m.window.first_needed_block(end)

    def admit(self, rid: str, tokens: list[int], chunk: int) -> None:
        hit = self.m.find_prefix(tokens)
        k = hit.num_skipped
        assert hit.num_tokens == (k + len(hit.blocks)) * self.bs <= len(tokens) - 1
        if not self.m.enable_prefix_caching:
            assert hit.blocks == []
        if self.m.window is None:
            assert k == 0
        else:  # exactly the blocks the first uncomputed token's window needs are held
            assert k == self.m.window.first_needed_block(hit.num_tokens)
        for i, b in enumerate(hit.blocks, start=k):
            assert self.shadow.get(b) == tuple(tokens[:(i + 1) * self.bs]), "wrong prefix hit"
        end = min(len(tokens), hit.num_tokens + chunk)
        if not self.try_allocate(rid, end, hit):
            return
        assert self.m.held_blocks(rid)[:len(hit.blocks)] == hit.blocks
        self.tokens[rid] = list(tokens)
        self.computed[rid] = hit.num_tokens
        self.preempted.pop(rid, None)
        self.compute(rid, end)

    def free(self, rid: str) -> None:
        self.m.free(rid)
        del self.tokens[rid], self.computed[rid]

    # -- rules ----------------------------------------------------------------------------------
    @rule(prompt=TOKENS, chunk=st.integers(1, 12))
    def add_request(self, prompt: list[int], chunk: int) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.admit(rid, prompt, chunk)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), k=st.integers(1, 5))
    def step(self, data: st.DataObject, k: int) -> None:
        """One engine step for a running request: a prefill chunk, or decode k sampled tokens."""
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens, computed = self.tokens[rid], self.computed[rid]
        if computed == len(tokens):
            tokens.extend(data.draw(st.lists(st.integers(0, 1), min_size=k, max_size=k)))
        end = min(len(tokens), computed + k)
        if self.try_allocate(rid, end):
            self.compute(rid, end)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.preempted[rid] = self.tokens[rid]
        self.free(rid)

    @precondition(lambda self: self.preempted)
    @rule(data=st.data(), chunk=st.integers(1, 16))
    def readd(self, data: st.DataObject, chunk: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.preempted)))
        self.admit(rid, self.preempted[rid], chunk)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        self.free(data.draw(st.sampled_from(sorted(self.tokens))))
        self.m.free("already-gone")  # unknown ids are no-ops

    @rule()
    def finish_all(self) -> None:
        for rid in sorted(self.tokens):
            self.free(rid)
        assert self.m.num_free_blocks == self.m.num_blocks and self.m.usage == 0.0

    @rule()
    def compact(self) -> None:
        """Move referenced blocks to the lowest ids (between steps); the KV moves along."""
        moves = self.m.compact()
        for src, dst in moves:
            self.shadow[dst] = self.shadow[src]
        assert self.m.fragmentation() == 0

    @precondition(lambda self: not self.tokens)
    @rule()
    def reset_prefix_cache(self) -> None:
        assert self.m.reset_prefix_cache()
        assert self.m.pool.cached == {}

    # -- invariants -----------------------------------------------------------------------------
    @invariant()
    def integrity(self) -> None:
        if not hasattr(self, "m"):
            return
        self.m.check_integrity()
        held: dict[int, list[tuple[str, int]]] = {}
        for rid in self.tokens:
            for i, b in enumerate(self.m.held_blocks(rid), start=self.m.num_skipped_blocks(rid)):
                held.setdefault(b, []).append((rid, i))
        assert self.m.num_free_blocks == self.m.num_blocks - len(held)
        for b, holders in held.items():
            if len(holders) > 1:  # shared: same position, identical computed content
                positions = {i for _, i in holders}
                assert len(positions) == 1, f"block {b} shared at different positions {holders}"
                (i,) = positions
                end = (i + 1) * self.bs
                contents = {tuple(self.tokens[r][:end]) for r, _ in holders}
                assert len(contents) == 1, f"block {b} shared by different token prefixes"
                assert all(self.computed[r] >= end for r, _ in holders), f"block {b} not full"
        if not self.tokens:
            assert self.m.num_free_blocks == self.m.num_blocks
        self.m.events.end_step()  # each rule is one engine step
        if self.mirrors is not None:
            assert not self.event_errors, self.event_errors
            cached = {hash_hex(v): b.block_id for v, b in self.m.pool.cached.items()}
            each, plain, batched = self.mirrors
            assert each.blocks == cached, "op + cache events do not rebuild the index"
            assert plain.blocks.keys() == cached.keys(), "cache events miss a hash"
            assert batched.blocks.keys() == cached.keys(), "the step batches miss a hash"


KVMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVManagerProperties = KVMachine.TestCase
