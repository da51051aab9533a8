"""Continuous (iteration-level) batching under a token budget. Pure Python: no torch.

Each step moves requests' ``num_computed_tokens`` toward ``num_tokens`` inside one budget of
``max_num_batched_tokens`` tokens and at most ``max_num_seqs`` running requests. A decode is a
1-token move, a prefill chunk a longer one; both share the step (STYLE 2).

Order of a step:
  1. running requests, most urgent first, each gets the tokens it needs (capped by the budget);
     when the KV pool has no block for one, the least urgent running request (highest priority
     value, latest arrival) is preempted by recompute: blocks freed, back to the waiting queue;
  2. if nothing was preempted, waiting requests are admitted in (priority, arrival) order while
     budget, ``max_num_seqs`` and free blocks allow, reusing cached prefix blocks.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from dataclasses import dataclass, field

from pagedllm.config import SchedulerConfig
from pagedllm.kv.manager import KVCacheManager
from pagedllm.request import Request, RequestStatus


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
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: list[tuple[tuple[int, int], Request]] = []  # heap by sort_key
        self.running: list[Request] = []  # kept sorted by sort_key
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self.num_preemptions = 0

    # -- queue management -------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        self.check_fits(req.num_prompt_tokens)
        req.arrival_seq = next(self._arrivals)
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        heapq.heappush(self.waiting, (req.sort_key, req))

    def check_fits(self, num_prompt_tokens: int) -> None:
        """A prompt that can never be served fails now, instead of waiting forever."""
        max_len = self.config.max_model_len
        if num_prompt_tokens == 0:
            raise ValueError("the prompt is empty; give at least one token")
        if num_prompt_tokens >= max_len:
            raise ValueError(
                f"the prompt has {num_prompt_tokens} tokens but max_model_len={max_len} leaves no "
                f"room to generate; shorten the prompt or raise --max-model-len"
            )
        blocks = -(-(num_prompt_tokens + 1) // self.kv.block_size)
        if blocks > self.kv.num_blocks:
            raise ValueError(
                f"the prompt needs {blocks} KV blocks of {self.kv.block_size} tokens but the pool "
                f"has {self.kv.num_blocks}; raise --kv-cache-memory / --num-kv-blocks"
            )

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (stop, length, abort) a request wherever it is; its blocks go back to the pool."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING:
            self.waiting = [(k, r) for k, r in self.waiting if r is not req]
            heapq.heapify(self.waiting)
        req.status = status
        self.kv.free(request_id)
        return req

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._allocate_or_preempt(req, n, out):
                break  # req itself was preempted; everything after it already was
            out.scheduled.append(ScheduledRequest(req, n, self.kv.block_table(req.request_id)))
            budget -= n
            i += 1

        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    def _allocate_or_preempt(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        while not self.kv.allocate_slots(req.request_id, req.num_computed_tokens + n):
            victim = self.running[-1]  # least urgent: sorted by (priority, arrival)
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        heapq.heappush(self.waiting, (req.sort_key, req))
        out.preempted.append(req.request_id)
        self.num_preemptions += 1

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        chunked = self.config.enable_chunked_prefill
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0][1]
            prefix = None
            computed = 0
            if req.params.prompt_logprobs is None and self.kv.enable_prefix_caching:
                prefix = self.kv.find_prefix(req.token_ids)
                computed = prefix.num_tokens
            n = req.num_tokens - computed
            if n > budget and not chunked:
                break
            n = min(n, budget)
            if not self.kv.allocate_slots(req.request_id, computed + n, prefix):
                break  # not enough free blocks: wait for running requests to finish
            heapq.heappop(self.waiting)
            req.num_computed_tokens = computed
            req.status = RequestStatus.RUNNING
            self._insert_running(req)
            out.scheduled.append(ScheduledRequest(req, n, self.kv.block_table(req.request_id)))
            budget -= n

    def _insert_running(self, req: Request) -> None:
        bisect.insort(self.running, req, key=lambda r: r.sort_key)

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance computed counts, append sampled tokens, apply token-level stops.

        Returns the requests that finished this step (already removed, blocks freed).
        """
        finished: list[Request] = []
        for s in out.scheduled:
            req = s.request
            if req.is_finished:
                continue
            req.num_computed_tokens += s.num_new_tokens
            token = sampled.get(req.request_id)
            if token is not None:
                req.append_token(token)
            self.kv.cache_blocks(req.request_id, req.token_ids, req.num_computed_tokens)
            if token is not None:
                status = req.check_stop()
                if status is not None:
                    self.finish_request(req.request_id, status)
                    finished.append(req)
        return finished

