"""Scheduler pieces for memory pressure: the step's output, preemption (recompute or swap,
for memory or for a more urgent request), swap-in, and forks (n > 1, beams). Pure Python.

Split out of ``scheduler.py`` to keep files short; ``Scheduler`` mixes ``PreemptionMixin`` in.
"""

from __future__ import annotations

import bisect
import heapq
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedllm.kv.swap import PreemptionCost, choose_preemption
from pagedllm.request import Request, RequestStatus

if TYPE_CHECKING:
    from pagedllm.config import SchedulerConfig
    from pagedllm.kv.manager import KVCacheManager, PrefixHit

logger = logging.getLogger("pagedllm.scheduler")


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    block_table: list[int]

    @property
    def start(self) -> int:
        """Position of the first new token (== num_computed_tokens at schedule time)."""
        return self.request.num_computed_tokens

    @property
    def end(self) -> int:
        return self.request.num_computed_tokens + self.num_new_tokens

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the request, so a new token is sampled."""
        return self.end == self.request.num_tokens


@dataclass
class SchedulerOutput:
    """One step's work. The runner applies, in order: ``swap_out`` (device -> host),
    ``block_copies`` (copy-on-write, device -> device), ``swap_in`` (host -> device), then the
    forward of ``scheduled``. Every list is applied as one batched move."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) device ids
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class PreemptionMixin:
    """Mixed into ``Scheduler``; uses its queues and KV manager."""

    config: SchedulerConfig
    kv: KVCacheManager
    waiting: list[tuple[tuple[int, int], Request]]
    running: list[Request]
    swapped: list[Request]
    requests: dict[str, Request]
    num_preemptions: int
    preemptions_by_kind: dict[str, int]
    cost_model: PreemptionCost
    _forks: dict[str, list[Request]]
    _fork_parent: dict[str, str]

    if TYPE_CHECKING:
        def _insert_running(self, req: Request) -> None: ...
        def _wanted(self, req: Request) -> int: ...
        def _next_arrival(self) -> int: ...
        def is_urgent(self, req: Request) -> bool: ...
        @property
        def reserved_blocks(self) -> int: ...
        def _try_allocate(self, req: Request, total: int,
                          prefix: PrefixHit | None = None) -> bool: ...

    def _preempt(self, req: Request, out: SchedulerOutput, for_priority: bool = False) -> None:
        """Swap the victim to the host tier or free it for recompute (``preemption_mode``)."""
        self.running.remove(req)
        rid = req.request_id
        how, why = choose_preemption(self.config.preemption_mode, self.cost_model,
                                     req.num_computed_tokens, len(self.kv.block_table(rid)),
                                     self.kv.num_free_host_blocks)
        pairs = self.kv.swap_out(rid) if how == "swap" else None
        if pairs is not None:
            out.swap_out.extend(pairs)
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
        refund = 0
        for j, s in enumerate(out.scheduled):
            if s.request is victim:
                refund = out.scheduled.pop(j).num_new_tokens
                break
        logger.info("preempting %s (priority %d) for %s (priority %d)", victim.request_id,
                    victim.priority, req.request_id, req.priority)
        self._preempt(victim, out, for_priority=True)
        return refund

    def _swap_in(self, req: Request, out: SchedulerOutput, budget: int) -> int | None:
        """Bring a swapped request back (and schedule it if it can); tokens used, or None."""
        need = self.kv.num_swap_in_blocks(req.request_id)
        reserve = 0 if self.is_urgent(req) or not self.running else self.reserved_blocks
        if need > self.kv.num_free_blocks - reserve:
            return None
        pairs = self.kv.swap_in(req.request_id)
        assert pairs is not None
        out.swap_in.extend(pairs)
        self.swapped.remove(req)
        req.status = RequestStatus.RUNNING
        self._insert_running(req)
        n = min(self._wanted(req), budget)
        if n <= 0 or not self._try_allocate(req, req.num_computed_tokens + n):
            return 0  # running again; scheduled from the next step
        out.scheduled.append(ScheduledRequest(req, n, self.kv.block_table(req.request_id)))
        return n

    def _seats_taken(self) -> int:
        """Running requests plus the pending forks of running parents."""
        pending = sum(len(f) for p, f in self._forks.items()
                      if self.requests[p].status == RequestStatus.RUNNING)
        return len(self.running) + pending

    def _fork_children(self, parent: Request) -> None:
        """Give each pending child the parent's blocks for all but the last prompt token."""
        point = parent.num_prompt_tokens - 1
        for child in self._forks.pop(parent.request_id):
            del self._fork_parent[child.request_id]
            self.kv.fork(parent.request_id, child.request_id, point)
            child.num_computed_tokens = point
            child.status = RequestStatus.RUNNING
            self._insert_running(child)

    def fork_request(self, parent: Request, child: Request) -> None:
        """Start ``child`` (e.g. a beam) running on ``parent``'s computed blocks, by reference.
        ``child.token_ids`` must extend ``parent``'s first ``num_computed_tokens`` tokens."""
        if child.request_id in self.requests:
            raise ValueError(f"request_id {child.request_id!r} is already in use")
        self.kv.fork(parent.request_id, child.request_id, parent.num_computed_tokens)
        child.arrival_seq = self._next_arrival()
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = RequestStatus.RUNNING
        self.requests[child.request_id] = child
        self._insert_running(child)
