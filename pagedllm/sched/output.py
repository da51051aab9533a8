"""What one step is: ``SchedulerOutput``, the only thing the runner is told. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.request import Request


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
