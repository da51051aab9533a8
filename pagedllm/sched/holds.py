"""Held KV: a finished request's blocks kept, by reference, so that a later request can start on
them (``EngineCoreRequest.keep_kv_s`` / ``fork_of``). Pure Python: no torch.

Why: a front end that continues a finished sequence in a new request (beam search's rounds,
``pagedllm.engine.beam``) would otherwise recompute its prefix every round (3.7x slower for beam
search) or depend on the prefix cache, which covers full blocks only and may be off.

::

    request A finishes (keep_kv_s=30)      A's table stays in the KV manager, under A's id:
                                           a hold of its computed tokens, until it expires
    request B arrives (fork_of=A)          B = A's tokens + more: ``kv.fork(A, B, n)`` shares
                                           A's blocks (ref counts), a partial last block is
                                           copied on B's first write; B runs from n computed
    Abort([A]), expiry, shutdown           the hold ends: ``kv.free(A)``, every block A alone
                                           held goes back to the pool

A hold is no request: the scheduler neither schedules nor preempts it, and its id stays taken
until it ends. A ``fork_of`` whose hold is gone (expired, released, never made) is ignored: the
request is admitted like any other (its prefix found in the prefix cache, or recomputed).
Expiry is checked at the start of each step (``Scheduler.schedule``); when the pool is short the
scheduler ends the oldest holds before it preempts a request or leaves one waiting.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

from pagedllm.kv.manager import KVCacheManager
from pagedllm.request import Request, RequestStatus


class Hold(NamedTuple):
    expires: float  # on ``KVHolds.clock``
    token_ids: tuple[int, ...]  # the computed tokens whose K/V the blocks hold
    arrival_seq: int  # its request's place in line, which a fork keeps


class KVHolds:
    """The held requests' ids -> their holds; the blocks themselves stay in ``kv``'s tables."""

    def __init__(self, kv: KVCacheManager, clock: Callable[[], float] = time.monotonic) -> None:
        self.kv = kv
        self.clock = clock
        self.held: dict[str, Hold] = {}

    def __len__(self) -> int:
        return len(self.held)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.held

    def keep_or_free(self, req: Request) -> None:
        """``req`` just finished: hold its blocks if it asked to (``keep_kv_s``) and ended by a
        stop or its length with its blocks on the device and none freed behind a sliding
        window; else free them."""
        rid = req.request_id
        ok = req.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)
        if (req.keep_kv_s is None or not ok or not self.kv.has_request(rid)
                or self.kv.num_skipped_blocks(rid) or not req.num_computed_tokens):
            self.kv.free(rid)
            return
        self.held[rid] = Hold(self.clock() + req.keep_kv_s,
                              tuple(req.token_ids[:req.num_computed_tokens]), req.arrival_seq)

    def fork(self, req: Request) -> int | None:
        """Start ``req`` on its ``fork_of``'s held blocks (its computed count set); returns the
        held request's ``arrival_seq`` (its place in line, which ``req`` keeps), None if there is
        no hold. ValueError, nothing changed, if ``req``'s tokens do not extend the held ones."""
        hold = self.held.get(req.fork_of) if req.fork_of is not None else None
        if hold is None:
            return None
        n = len(hold.token_ids)
        if req.num_tokens <= n or tuple(req.token_ids[:n]) != hold.token_ids:
            raise ValueError(f"fork_of={req.fork_of!r}: the prompt must extend that request's "
                             f"{n} computed tokens by at least one")
        assert req.fork_of is not None
        self.kv.fork(req.fork_of, req.request_id, n)
        req.num_computed_tokens = n
        req.num_cached_tokens = n
        return hold.arrival_seq

    def release(self, request_id: str) -> bool:
        """End a hold (an abort of its id); False if there is none."""
        if self.held.pop(request_id, None) is None:
            return False
        self.kv.free(request_id)
        return True

    def release_oldest(self) -> bool:
        """The pool is short: end the oldest hold (False if none). A hold only saves a
        recomputation, so it goes before any request is preempted or kept waiting."""
        return bool(self.held) and self.release(next(iter(self.held)))

    def expire(self) -> list[str]:
        """End the holds whose time is up; returns their ids."""
        now = self.clock()
        gone = [rid for rid, h in self.held.items() if h.expires <= now]
        for rid in gone:
            self.release(rid)
        return gone

    def release_all(self) -> None:
        for rid in list(self.held):
            self.release(rid)
