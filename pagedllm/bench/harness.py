"""The one way the benchmarks time things: warm up, interleave repetitions, keep the fastest.

On a shared machine load only ever adds time, so each contender's fastest repetition is the
least noisy estimate of its own cost, and rotating the order every repetition (rep r starts at
contender r) makes load drifts hit all contenders alike. The median and the spread are kept too,
to show how noisy the run was. ``interleaved`` runs the contenders; ``timing`` summarises one
contender's times; ``Backend`` is what ``bench throughput`` runs a workload on.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from pagedllm.bench.baselines import RunResult
    from pagedllm.bench.workload import BenchRequest

T = TypeVar("T")
R = TypeVar("R")


class Backend(Protocol):
    """A system that runs a whole workload offline (every request submitted at once, greedy,
    ``ignore_eos``); built once, run many times."""

    name: str

    def run(self, reqs: list[BenchRequest]) -> RunResult: ...


def interleaved(items: Sequence[T], run: Callable[[T], R], reps: int,
                warmup: Callable[[T], object] | None = None) -> list[list[R]]:
    """``warmup(item)`` once per item, then ``run(item)`` ``reps`` times per item, repetition r
    in the order rotated by r. Returns each item's results, in item order."""
    if warmup is not None:
        for item in items:
            warmup(item)
    out: list[list[R]] = [[] for _ in items]
    for rep in range(reps):
        k = rep % len(items) if items else 0
        for i in list(range(k, len(items))) + list(range(k)):
            out[i].append(run(items[i]))
    return out


def timing(times: Sequence[float]) -> dict[str, Any]:
    """The fastest time (the estimate), every time, the median and the relative spread."""
    best = min(times)
    return {
        "elapsed_s": best,
        "elapsed_s_all": list(times),
        "elapsed_s_median": statistics.median(times),
        "elapsed_s_spread": (max(times) - best) / best if best else 0.0,
    }
