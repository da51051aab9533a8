"""The traditional baseline: reserve ``max_model_len`` tokens of KV per request, batch statically.

This is how inference servers managed KV memory before paging (and what a hand-written
``generate`` loop does): each admitted request gets a contiguous region sized for the longest
sequence it could ever reach, and a new batch starts only when every request of the previous
one has finished. It runs inside pagedllm's own engine (``LLMEngine(config, ContiguousScheduler)``)
with the same model code and attention kernels, so any difference from the default scheduler is
the memory management and the scheduling alone.

"Contiguous" is modelled by reservation, not by address: a request holds
``ceil(max_model_len / block_size)`` blocks from admission to finish, so exactly as many requests
fit in a pool as would fit contiguous ``max_model_len`` regions. Only the KV manager's public API
(``allocate_slots``, ``free``, ``block_table``, ``cache_blocks``) and ``Request`` fields are used;
the queues are owned here so that this policy does not depend on the default scheduler's
internals.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Mapping

from pagedllm.config import SchedulerConfig
from pagedllm.kv.manager import KVCacheManager
from pagedllm.request import Request, RequestStatus
from pagedllm.sched import ScheduledRequest, Scheduler, SchedulerOutput
from pagedllm.sched.admission import check_fits


class ContiguousScheduler(Scheduler):
    """FCFS static batching with a full ``max_model_len`` reservation per request.

    ``update()`` is inherited: with no forks (n=1 only) it is exactly the per-step bookkeeping
    this policy needs, so both policies pay the same cost outside ``schedule()``."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        super().__init__(config, kv)
        self.queue: deque[Request] = deque()  # FCFS
        self.running: list[Request] = []  # the current static batch
        self.reserve_tokens = config.max_model_len
        self.blocks_per_request = -(-config.max_model_len // kv.block_size)
        self._seq = itertools.count()

    # -- queue management -------------------------------------------------------------------
    def add_request(self, req: Request, forks: list[Request] | None = None) -> None:
        if forks:
            raise ValueError("the contiguous baseline runs one sequence per request (n=1)")
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        check_fits(self.config, self.kv, req.num_prompt_tokens)
        if self.blocks_per_request > self.kv.num_blocks:
            raise ValueError(
                f"the contiguous baseline reserves {self.blocks_per_request} blocks per request "
                f"but the pool has {self.kv.num_blocks}; raise --num-kv-blocks")
        req.arrival_seq = next(self._seq)
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self.queue.append(req)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        elif req in self.queue:
            self.queue.remove(req)
        req.status = status
        self.kv.free(request_id)
        return req

    @property
    def num_waiting(self) -> int:
        return len(self.queue)

    # -- one step -----------------------------------------------------------------------------
    def schedule(self, proposals: Mapping[str, list[int]] | None = None) -> SchedulerOutput:
        """The baseline verifies no proposals (speculative decoding is not part of it)."""
        out = SchedulerOutput()
        if not self.running:  # static batching: admit only when the previous batch is done
            while self.queue and len(self.running) < self.config.max_num_seqs:
                req = self.queue[0]
                if not self.kv.allocate_slots(req.request_id, self.reserve_tokens):
                    break  # the pool holds no further max_model_len region
                self.queue.popleft()
                req.num_computed_tokens = 0
                req.status = RequestStatus.RUNNING
                self.running.append(req)
        budget = self.config.max_num_batched_tokens
        for req in self.running:
            if budget <= 0:
                break
            need = req.num_tokens - req.num_computed_tokens
            n = min(need, budget)
            if n <= 0 or (n < need and not self.config.enable_chunked_prefill):
                continue
            out.scheduled.append(ScheduledRequest(req, n, self.kv.block_table(req.request_id)))
            budget -= n
        return out
