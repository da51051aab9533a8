"""The scheduler's side of speculative decoding (pure Python, no torch): which proposals a step
verifies, and the tokens a verification appends. ``sched/scheduler.py`` calls these."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from pagedllm.kv.manager import KVCacheManager
from pagedllm.request import Request, RequestStatus
from pagedllm.sched.output import ScheduledRequest


def proposals_to_verify(req: Request, proposals: Mapping[str, list[int]] | None, n: int,
                        budget: int, num_after: int, kv: KVCacheManager,
                        allocate: Callable[[Request, int], bool]) -> list[int]:
    """The part of ``req``'s proposals (``proposals[req.request_id]``) this step verifies, its
    slots allocated (``allocate``: the scheduler's ``_try_allocate``): only for a decode, within
    the token budget and the tokens ``req`` may still generate, and only from blocks the
    ``num_after`` running requests after it do not need for their decodes (one each at most), so
    proposals never cause a preemption."""
    spec = proposals.get(req.request_id) if proposals else None
    if not spec or n != 1 or req.num_computed_tokens != req.num_tokens - 1:
        return []
    spec = spec[: max(0, min(budget - 1, req.max_output_tokens - req.num_output_tokens - 1))]
    total = req.num_tokens + len(spec)
    if kv.num_blocks_needed(req.request_id, total) > kv.num_free_blocks - num_after:
        return []
    return spec if spec and allocate(req, total) else []


def keep_accepted(s: ScheduledRequest, token: int | None, accepted: dict[str, int] | None,
                  kv: KVCacheManager) -> RequestStatus | None:
    """After the step's forward, append what ``s.request`` gains: its first ``accepted[rid]``
    proposals, then the sampled ``token``, stopping at a token-level stop (returned). The rejected
    proposals' positions are rolled back (computed count, and the blocks past it:
    ``KVCacheManager.rollback``)."""
    req = s.request
    new = [] if token is None else [token]
    if s.spec_token_ids:
        a = accepted.get(req.request_id, 0) if accepted else 0
        req.num_computed_tokens -= len(s.spec_token_ids) - a
        kv.rollback(req.request_id, req.num_computed_tokens)
        new = s.spec_token_ids[:a] + new
    for t in new:
        req.append_token(t)
        status = req.check_stop()
        if status is not None:
            return status
    return None
