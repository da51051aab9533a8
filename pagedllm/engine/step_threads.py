"""The served engine core's torch threads, chosen per step (``StepThreads``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.sched.output import SchedulerOutput


class StepThreads:
    """The served core's torch threads, per step: ``large`` for a step of more than
    ``threshold`` tokens (prefill: compute-bound, and few tokens for the API process to
    stream), ``small`` otherwise (decode: the API process streams every row's token and needs
    the core left to it). Off unless ``--prefill-threads`` asks: on 2 cores it gave TPOT 0.90x
    and no throughput gain (docs/performance/serving.md)."""

    def __init__(self, small: int, large: int, threshold: int = 256,
                 set_threads: Callable[[int], None] | None = None) -> None:
        if set_threads is None:
            import torch

            set_threads = torch.set_num_threads
        self.small, self.large, self.threshold = small, large, threshold
        self.current = small
        self._set = set_threads

    def apply(self, sched: SchedulerOutput) -> None:
        want = self.large if sched.num_batched_tokens > self.threshold else self.small
        if want != self.current:
            self._set(want)
            self.current = want
