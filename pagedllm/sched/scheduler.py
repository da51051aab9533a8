"""Continuous (iteration-level) batching under a token budget. Pure Python: no torch.

Each step moves requests' ``num_computed_tokens`` toward ``num_tokens`` inside one budget of
``max_num_batched_tokens`` tokens and at most ``max_num_seqs`` running requests. A decode is a
1-token move, a prefill chunk a longer one; both share the step (STYLE 2).

Priorities: lower ``priority`` = more urgent (as in vLLM); ties go by arrival. Requests with
``priority <= urgent_priority`` (default 0, so by default every request) form the *urgent class*.
The last ``reserved_fraction`` of the pool's blocks (``reserved_blocks``) is theirs: a less urgent
request may not allocate into it, unless it is the only running request (so that it can always
make progress; an urgent arrival then preempts it).

Order of a step (``KVMemoryPolicy``, sched/memory.py, may first grow an elastic pool):
  1. running requests, most urgent first, each gets the tokens it needs (capped by the budget);
     when the KV pool has no block for one, the least urgent running request (highest priority
     value, latest arrival) is preempted (recompute: blocks freed, back to the waiting queue;
     swap: blocks copied to the host tier, see ``pagedllm.kv.host_tier``; which of the two:
     ``pagedllm.sched.preemption``);
  2. if nothing was preempted for memory, swapped-out and waiting requests are admitted, most
     urgent first, while budget, ``max_num_seqs`` and free blocks allow, reusing cached prefix
     blocks. A request that cannot be admitted preempts running requests that are strictly less
     urgent than it (unscheduling them from this step) until it fits.
LoRA adapters live in the pool too (sched/adapters.py): a request's is paged in before it is
admitted, and idle adapters' pages go before any request is preempted for blocks.

Sliding-window models (``kv.window``): after each step a request's blocks that left the window
are freed (``KVCacheManager.free_outside_window``), and a prefill chunk that does not fit is cut
to what does, so such a request moves on with ``max_blocks_held(window, block_size)`` blocks.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import logging
from collections.abc import Mapping

from pagedllm.config import SchedulerConfig
from pagedllm.kv.manager import KVCacheManager, PrefixHit
from pagedllm.kv.transfer import KVTransfer
from pagedllm.lora.request import LoRAPlaces
from pagedllm.request import Request, RequestStatus
from pagedllm.sched.adapters import AdapterResidency
from pagedllm.sched.admission import check_adapter_fits, check_fits
from pagedllm.sched.holds import KVHolds
from pagedllm.sched.memory import KVMemoryPolicy
from pagedllm.sched.output import ScheduledRequest, SchedulerOutput
from pagedllm.sched.preemption import PreemptionCost, choose_preemption
from pagedllm.spec_decode.schedule import keep_accepted, proposals_to_verify

__all__ = ["Scheduler", "ScheduledRequest", "SchedulerOutput"]

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: list[tuple[tuple[int, int, int], Request]] = []  # heap by sort_key
        self.running: list[Request] = []  # kept sorted by sort_key
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self.swapped: list[Request] = []  # preempted to the host tier, kept sorted by sort_key
        self.num_steps = 0  # schedule() calls: the step number (stamps the KV trace)
        self.num_preemptions = 0
        # by mechanism (recompute, swap) and, separately, how many were for a more urgent request
        self.preemptions_by_kind: dict[str, int] = {"recompute": 0, "swap": 0, "priority": 0}
        self.cost_model = PreemptionCost()  # for preemption_mode="auto"; the engine refines it
        # grow / compact / shrink; the engine replaces it with one built from its CacheConfig
        self.memory = KVMemoryPolicy(kv, max_num_batched_tokens=config.max_num_batched_tokens)
        # n > 1: parent id -> children forked from it once its prompt (less the last token) is in
        self._forks: dict[str, list[Request]] = {}
        self._fork_parent: dict[str, str] = {}  # pending child id -> parent id
        self.holds = KVHolds(kv)  # finished requests' blocks kept for a later fork_of
        self.adapters = AdapterResidency(kv, self.running, self.holds, config.max_loras is not None)
        self.external: KVTransfer | None = None  # the cluster KV tier (--kv-transfer-config)

    # -- queue management -------------------------------------------------------------------
    def add_request(self, req: Request, forks: list[Request] | None = None) -> None:
        """Queue ``req``. ``forks`` (n > 1 siblings with the same prompt) are not prefilled: when
        ``req`` has computed all but the last prompt token they fork its block table (shared by
        reference count, copy-on-write) and join the running batch. A ``req.fork_of`` held
        (``sched/holds.py``) starts on its blocks and runs at once, in its place in line."""
        forks = list(forks or [])
        for r in [req, *forks]:
            if r.request_id in self.requests or r.request_id in self.holds:
                raise ValueError(f"request_id {r.request_id!r} is already in use")
        check_fits(self.config, self.kv, req.num_prompt_tokens)  # a prompt never served fails now
        check_adapter_fits(self.config, self.kv, req)  # its LoRA adapter's pages beside its KV
        kept = None if forks else self.adapters.fork_hold(req)  # its arrival_seq, if it forked one
        if req.num_prompt_tokens < 2:  # nothing to share: queue them as independent requests
            reqs, forks = [req, *forks], []
        else:
            reqs = [req]
        for r in [*reqs, *forks]:
            r.arrival_seq = next(self._arrivals)
            r.status = RequestStatus.WAITING
            self.requests[r.request_id] = r
        if kept is not None:  # forked on a held request's blocks: keeps its place, runs now
            req.fork_seq, req.arrival_seq = req.arrival_seq, kept
            req.status = RequestStatus.RUNNING
            self._insert_running(req)
            return
        for r in reqs:
            heapq.heappush(self.waiting, (r.sort_key, r))
        if forks:
            self._forks[req.request_id] = forks
            for f in forks:
                self._fork_parent[f.request_id] = req.request_id

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (stop, length, abort) a request wherever it is; its blocks go back to the pool."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        parent = self._fork_parent.pop(request_id, None)
        if parent is not None:  # a child not forked yet
            self._forks[parent].remove(req)
        elif req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif any(r is req for r in self.swapped):
            self.swapped.remove(req)
        elif req.status == RequestStatus.WAITING:
            self.waiting = [(k, r) for k, r in self.waiting if r is not req]
            heapq.heapify(self.waiting)
        for child in self._forks.pop(request_id, []):  # orphans become independent requests
            del self._fork_parent[child.request_id]
            heapq.heappush(self.waiting, (child.sort_key, child))
        req.status = status
        self.holds.keep_or_free(req)  # its blocks back to the pool, or held (``keep_kv_s``)
        return req

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    # -- priorities -----------------------------------------------------------------------------
    def is_urgent(self, req: Request) -> bool:
        return req.priority <= self.config.urgent_priority

    @property
    def reserved_blocks(self) -> int:
        """Blocks only the urgent class may allocate (floor of reserved_fraction * pool)."""
        return int(self.config.reserved_fraction * self.kv.num_blocks)

    def _fits(self, req: Request, total: int, prefix: PrefixHit | None = None) -> bool:
        """Whether ``allocate_slots`` would succeed, a less urgent request being refused the
        reserved blocks (unless it would run alone)."""
        alone = not self.running or self.running == [req]
        free = self.kv.num_free_blocks
        if not self.is_urgent(req) and not alone:
            free -= self.reserved_blocks
        return self.kv.num_blocks_needed(req.request_id, total, prefix) <= free

    def _try_allocate(self, req: Request, total: int, prefix: PrefixHit | None = None) -> bool:
        return self._fits(req, total, prefix) and self.kv.allocate_slots(req.request_id, total,
                                                                          prefix)

    def _allocate_chunk(self, req: Request, computed: int, n: int,
                        prefix: PrefixHit | None = None) -> int:
        """Allocate slots for ``n`` new tokens after ``computed``: ``n``, or for a windowed
        prefill chunk that does not fit, the longest shorter chunk that does; 0 if none."""
        if self._try_allocate(req, computed + n, prefix):
            return n
        if self.kv.window is None or n <= 1 or not self.config.enable_chunked_prefill:
            return 0
        lo, hi = 0, n - 1  # the longest chunk that fits: needed blocks grow with the chunk
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self._fits(req, computed + mid, prefix) else (lo, mid - 1)
        return lo if lo and self._try_allocate(req, computed + lo, prefix) else 0

    def _wanted(self, req: Request) -> int:
        """Tokens ``req`` would compute now: all left; a parent with pending forks stops at them."""
        if req.request_id in self._forks:
            return req.num_prompt_tokens - 1 - req.num_computed_tokens
        return req.num_tokens - req.num_computed_tokens

    def _fork_if_due(self, req: Request) -> None:
        """Fork ``req``'s pending n > 1 children once all but its prompt's last token is in."""
        if req.request_id in self._forks and req.num_computed_tokens >= req.num_prompt_tokens - 1:
            self._fork_children(req)

    # -- one step -----------------------------------------------------------------------------
    def schedule(self, proposals: Mapping[str, list[int]] | None = None) -> SchedulerOutput:
        """The step's work. ``proposals`` (speculative decoding): request id -> tokens proposed
        to follow its tokens; a decode verifies what fits (``ScheduledRequest.spec_token_ids``)."""
        self.num_steps += 1
        self.holds.expire()
        out = SchedulerOutput()
        self.memory.grow(out, self.requests.values(), len(self.running))
        budget = self.config.max_num_batched_tokens
        i, loras = 0, LoRAPlaces(self.config.max_loras)  # this step's adapters (lora/request.py)
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(self._wanted(req), budget)
            if n <= 0 or not loras.admits(req.lora_request):
                i += 1
                continue
            spec = proposals_to_verify(req, proposals, n, budget, len(self.running) - 1 - i,
                                       self.kv, self._try_allocate)
            n = n if spec else self._allocate_or_preempt(req, n, out)
            if not n:
                break  # req itself was preempted; everything after it already was
            out.scheduled.append(ScheduledRequest(req, n + len(spec),
                                                  self.kv.block_table(req.request_id), spec))
            budget -= n + len(spec)
            i += 1

        if not out.preempted:
            self._admit_waiting(out, budget, loras)
        out.kv.block_copies = self.kv.take_block_copies()
        self.adapters.finish_step(out)  # LoRA adapters paged in and out (sched/adapters.py)
        return out

    def _allocate_or_preempt(self, req: Request, n: int, out: SchedulerOutput) -> int:
        """Tokens allocated for ``req`` (``n``, or a shorter windowed chunk); 0 if it was
        preempted itself."""
        while not (got := self._allocate_chunk(req, req.num_computed_tokens, n)):
            if self.adapters.page_out_idle():  # idle adapters' pages go first (a cache),
                continue
            if self.holds.release_oldest():  # then held KV, before any running request
                continue
            victim = self.running[-1]  # least urgent: sorted by (priority, arrival)
            self._preempt(victim, out)
            if victim is req:
                return 0
        return got

    def _admit_waiting(self, out: SchedulerOutput, budget: int, loras: LoRAPlaces) -> None:
        while (self.waiting or self.swapped) and budget > 0:
            from_host = bool(self.swapped) and (
                not self.waiting or self.swapped[0].sort_key < self.waiting[0][0])
            req = self.swapped[0] if from_host else self.waiting[0][1]
            if not loras.admits(req.lora_request) or not self.adapters.make_resident(req):
                break  # first come, first served: nothing younger jumps the queue
            seats = 1 + len(self._forks.get(req.request_id, ()))
            if self.running and self._seats_taken() + seats > self.config.max_num_seqs:
                refund = self._preempt_for(req, out)
                if refund is None:
                    break
                budget += refund
                continue
            if from_host:
                used = self._swap_in(req, out, budget)
                if used is None and (self.adapters.page_out_idle(req) or self.holds.release_oldest()):
                    continue
                if used is None:
                    refund = self._preempt_for(req, out)
                    if refund is None:
                        break
                    used = -refund
                budget -= used
                continue
            prefix, computed, found = None, 0, None
            if req.params.prompt_logprobs is None and self.kv.enable_prefix_caching:
                prefix = self.kv.find_prefix(req.token_ids, req.prefix_keys, record_stats=False)
                computed = prefix.num_tokens
                if self.external is not None:  # the blocks after the local hit, from the tier
                    found = self.external.lookup(req.request_id, req.token_ids, req.prefix_keys,
                                                 prefix)
                    computed += 0 if found is None else found.num_tokens
            n = self._wanted(req) - computed  # waiting requests have computed nothing
            if n == 0:  # a parent whose hit covers the fork point: fork now, then run 1 token
                n = 1
            if n > budget and not self.config.enable_chunked_prefill:
                break
            n = self._allocate_chunk(req, computed, min(n, budget), prefix)
            if not n and (self.adapters.page_out_idle(req) or self.holds.release_oldest()):
                continue
            if not n:
                refund = self._preempt_for(req, out)
                if refund is None:
                    break  # not enough free blocks: wait for running requests to finish
                budget += refund
                continue
            heapq.heappop(self.waiting)
            self.kv.record_prefix_query(req.num_tokens, 0 if prefix is None else prefix.num_tokens)
            if self.external is not None:  # loads into the new table's fresh blocks
                out.kv.loads += self.external.admitted(req.request_id, req.num_tokens, found,
                                                       self.kv.block_table(req.request_id))
            req.num_cached_tokens = computed if req.num_cached_tokens is None else req.num_cached_tokens
            req.num_computed_tokens = computed
            req.status = RequestStatus.RUNNING
            self._insert_running(req)
            self._fork_if_due(req)
            out.scheduled.append(ScheduledRequest(req, n, self.kv.block_table(req.request_id)))
            budget -= n

    def _insert_running(self, req: Request) -> None:
        bisect.insort(self.running, req, key=lambda r: r.sort_key)

    # -- preemption, swap-in, forks -------------------------------------------------------------
    def _preempt(self, req: Request, out: SchedulerOutput, for_priority: bool = False) -> None:
        """Swap the victim to the host tier or free it for recompute (``preemption_mode``)."""
        self.running.remove(req)
        rid = req.request_id
        how, why = choose_preemption(self.config.preemption_mode, self.cost_model,
                                     req.num_computed_tokens, len(self.kv.held_blocks(rid)),
                                     self.kv.num_free_host_blocks)
        pairs = self.kv.swap_out(rid) if how == "swap" else None
        if pairs is not None:
            out.kv.swap_out.extend(pairs)
            bisect.insort(self.swapped, req, key=lambda r: r.sort_key)
        else:
            how = "recompute"
            self.kv.free(rid)
            req.num_computed_tokens = 0
            heapq.heappush(self.waiting, (req.sort_key, req))
        logger.info("preempt %s by %s: %s", rid, how, why)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        out.preempted.append(rid)
        self.num_preemptions += 1
        self.preemptions_by_kind[how] += 1
        self.preemptions_by_kind["priority"] += for_priority

    def _preempt_for(self, req: Request, out: SchedulerOutput) -> int | None:
        """Preempt the least urgent running request if it is strictly less urgent than ``req``.
        Returns the tokens it had been scheduled this step (refunded), or None if no victim."""
        if not self.running or self.running[-1].priority <= req.priority:
            return None
        victim = self.running[-1]
        j = next((j for j, s in enumerate(out.scheduled) if s.request is victim), None)
        refund = 0 if j is None else out.scheduled.pop(j).num_new_tokens
        logger.info("preempting %s (priority %d) for %s (priority %d)", victim.request_id,
                    victim.priority, req.request_id, req.priority)
        self._preempt(victim, out, for_priority=True)
        return refund

    def _swap_in(self, req: Request, out: SchedulerOutput, budget: int) -> int | None:
        """Bring a swapped request back (and schedule it if it can); tokens used, or None."""
        need = self.kv.host.num_blocks_of(req.request_id)
        reserve = 0 if self.is_urgent(req) or not self.running else self.reserved_blocks
        if need > self.kv.num_free_blocks - reserve:
            return None
        pairs = self.kv.swap_in(req.request_id)
        assert pairs is not None
        out.kv.swap_in.extend(pairs)
        self.swapped.remove(req)
        req.status = RequestStatus.RUNNING
        self._insert_running(req)
        n = min(self._wanted(req), budget)
        if n <= 0 or not (n := self._allocate_chunk(req, req.num_computed_tokens, n)):
            return 0  # running again; scheduled from the next step
        out.scheduled.append(ScheduledRequest(req, n, self.kv.block_table(req.request_id)))
        return n

    def _seats_taken(self) -> int:
        """Running requests plus the pending forks of running parents."""
        running = RequestStatus.RUNNING
        return len(self.running) + sum(len(f) for p, f in self._forks.items()
                                       if self.requests[p].status == running)

    def _fork_children(self, parent: Request) -> None:
        """Give each pending child the parent's blocks for all but the last prompt token."""
        point = parent.num_prompt_tokens - 1
        for child in self._forks.pop(parent.request_id):
            del self._fork_parent[child.request_id]
            self.kv.fork(parent.request_id, child.request_id, point)
            child.num_computed_tokens = point
            child.status = RequestStatus.RUNNING
            self._insert_running(child)

    def end_step(self) -> SchedulerOutput | None:
        """After a step's outputs are processed: the KV-only step that compacts (a trigger fired)
        or shrinks the pool (idle), if any (``KVMemoryPolicy.end_step``)."""
        return self.memory.end_step(self.requests.values(), idle=not self.requests)

    def update(self, out: SchedulerOutput, sampled: dict[str, int],
               accepted: dict[str, int] | None = None) -> list[Request]:
        """Advance computed counts, append sampled tokens (after a verification's accepted
        proposals: ``keep_accepted``), fork n > 1 children, apply token-level stops. Returns the
        requests that finished this step (already removed, blocks freed)."""
        finished: list[Request] = []
        for s in out.scheduled:
            req = s.request
            if req.is_finished:
                continue
            req.num_computed_tokens += s.num_new_tokens
            status = keep_accepted(s, sampled.get(req.request_id), accepted, self.kv)
            self.kv.cache_blocks(req.request_id, req.token_ids, req.num_computed_tokens, req.prefix_keys)
            self.kv.free_outside_window(req.request_id, req.num_computed_tokens)
            self._fork_if_due(req)
            if status is not None:
                self.finish_request(req.request_id, status)
                finished.append(req)
        return finished
