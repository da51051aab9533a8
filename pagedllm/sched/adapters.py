"""The scheduler's side of LoRA adapters' pages (kv/adapters.py): which adapters must stay
resident, paging one in before its request is admitted, paging idle ones out for the KV cache,
and what a step tells the runner. Pure Python."""

from __future__ import annotations

from pagedllm.kv.manager import KVCacheManager
from pagedllm.request import Request
from pagedllm.sched.holds import KVHolds
from pagedllm.sched.output import SchedulerOutput


class AdapterResidency:
    def __init__(self, kv: KVCacheManager, running: list[Request], holds: KVHolds,
                 enabled: bool) -> None:
        """``running``: the scheduler's running list (read, never changed here)."""
        self.pages, self.running, self.holds, self.enabled = kv.adapters, running, holds, enabled

    def in_use(self, also: Request | None = None) -> set[int]:
        """Adapters of the requests holding KV (and of ``also``): never paged out."""
        reqs = self.running if also is None else [*self.running, also]
        return {r.lora_request.lora_int_id for r in reqs if r.lora_request is not None}

    def make_resident(self, req: Request) -> bool:
        """Whether ``req``'s adapter (if any) is resident now, paging it in (and idle ones out)
        if it fits; held KV is released before the request is made to wait."""
        lora = req.lora_request
        if lora is None:
            return True
        if lora.lora_int_id in self.pages.held:  # resident: no need for the set of those in use
            return self.pages.ensure(lora.lora_int_id, ())
        while not self.pages.ensure(lora.lora_int_id, self.in_use()):
            if not self.holds.release_oldest():
                return False
        return True

    def fork_hold(self, req: Request) -> int | None:
        """``holds.fork(req)`` (it runs at once on a held request's blocks) once its adapter is
        resident; None (it queues as any request) if the adapter cannot be paged in now."""
        if req.fork_of not in self.holds.held or not self.make_resident(req):
            return None
        return self.holds.fork(req)

    def page_out_idle(self, also: Request | None = None) -> bool:
        """Free an idle adapter's pages for the KV cache (before anything is preempted)."""
        return self.enabled and self.pages.evict_idle(self.in_use(also)) is not None

    def finish_step(self, out: SchedulerOutput) -> None:
        """The step's page-ins and page-outs, and where each adapter it runs lives."""
        if self.enabled:
            out.kv.lora_loads, out.kv.lora_evictions = self.pages.take_changes()
            ids = {s.request.lora_request.lora_int_id for s in out.scheduled
                   if s.request.lora_request is not None}
            out.kv.lora_pages = {i: self.pages.blocks_of(i) for i in ids}
