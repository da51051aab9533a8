"""``drive``: the one loop that runs an engine over a workload.

Requests are added as the clock reaches their arrival time, the engine steps until every one of
them has finished, and each request's outputs and times (queued, first token, finished, on the
drive's clock, stamped when the step that made them returns) are collected. ``LLM.generate`` /
``beam_search``, ``pagedllm generate``, ``LLMEngine.preheat``, every benchmark in ``bench/`` and
the planner's ``--compare`` and calibration run the engine through it, so they all see the
engine as one offline loop does; a caller that wants a step's record (``engine.stats``) reads
it in ``on_step``.

The other loop over ``step()`` is the engine core's busy loop (``engine/core_proc.py``): it
serves clients (the server, ``AsyncLLM``) that add and abort requests while it runs, has no
workload and never ends on its own. ``tests/test_one_drive.py`` pins that no third one appears.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pagedllm.outputs import RequestOutput


class Engine(Protocol):
    """What ``drive`` needs of an engine (``LLMEngine``)."""

    def step(self) -> list[RequestOutput]: ...

    def abort_request(self, request_id: str) -> bool: ...

    def has_unfinished_requests(self) -> bool: ...


@dataclass(frozen=True)
class Submission:
    """One request of a workload: ``add(request_id)`` queues it (``engine.add_request`` or
    ``add_beam_search`` with its arguments bound) once the clock reaches ``at`` seconds."""

    request_id: str
    add: Callable[[str], object]
    at: float = 0.0


class Clock:
    """Seconds since the drive began. ``read`` is the time source; ``sleeps``: when nothing runs,
    sleep until the next arrival (a wall clock), else skip to it, the gap added (a CPU-seconds
    clock: the run as a dedicated core would time it)."""

    def __init__(self, read: Callable[[], float] = time.perf_counter, sleeps: bool = True) -> None:
        self.read, self.sleeps = read, sleeps
        self.t0, self.skipped = read(), 0.0

    def now(self) -> float:
        return self.read() - self.t0 + self.skipped

    def wait_until(self, t: float) -> None:
        if self.sleeps:
            time.sleep(max(0.0, t - self.now()))
        else:
            self.skipped += max(0.0, t - self.now())


@dataclass
class DriveResult:
    """Per request id: its last output (the final one: finished) and its times on the clock."""

    outputs: dict[str, RequestOutput] = field(default_factory=dict)
    added: dict[str, float] = field(default_factory=dict)
    first_token: dict[str, float] = field(default_factory=dict)
    finished: dict[str, float] = field(default_factory=dict)
    elapsed: float = 0.0  # the clock when the last request finished
    num_steps: int = 0

    def in_order(self, ids: Sequence[str]) -> list[RequestOutput]:
        return [self.outputs[i] for i in ids]


def drive(engine: Engine, requests: Sequence[Submission], clock: Clock | None = None,
          on_step: Callable[[list[RequestOutput]], object] | None = None) -> DriveResult:
    """Run ``requests`` on ``engine`` until each has finished; ``on_step(outputs)`` after every
    step (``engine.stats`` is then that step's record). Requests of another front end on the
    same engine run along but are not waited for. On an error or an interrupt (an ``add`` that
    raises too) the requests added and not finished are aborted: none stays queued or holds
    blocks."""
    clock = clock or Clock()
    order = sorted(requests, key=lambda r: r.at)  # stable: equal arrivals keep their order
    res = DriveResult()
    pending: set[str] = set()  # added, not finished
    nxt = 0
    try:
        while nxt < len(order) or pending:
            now = clock.now()
            while nxt < len(order) and order[nxt].at <= now:
                r = order[nxt]
                r.add(r.request_id)
                res.added[r.request_id] = now
                pending.add(r.request_id)
                nxt += 1
            if not pending:
                clock.wait_until(order[nxt].at)
                continue
            outs = engine.step()
            res.num_steps += 1
            _record(res, outs, pending, clock.now())
            if on_step is not None:
                on_step(outs)
            if pending and not engine.has_unfinished_requests():
                raise RuntimeError(f"requests {sorted(pending)} left the engine without a "
                                   f"finished output")
    finally:
        for rid in pending:
            engine.abort_request(rid)
    res.elapsed = clock.now()
    return res


def _record(res: DriveResult, outs: list[RequestOutput], pending: set[str], now: float) -> None:
    for o in outs:
        rid = o.request_id
        if rid not in pending:
            continue  # another front end's request
        res.outputs[rid] = o
        if rid not in res.first_token and any(c.token_ids for c in o.outputs):
            res.first_token[rid] = now
        if o.finished:
            res.finished[rid] = now
            pending.discard(rid)
