"""What one step is: ``SchedulerOutput``, the scheduler's record of it (engine side: it holds the
live Requests; the executor is told ``runner.model_input.ModelInput``, built from it). Pure
Python."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.request import Request


@dataclass
class ScheduledRequest:
    """``num_new_tokens`` positions from ``start``. With ``spec_token_ids`` (speculative
    decoding: the part of the step's proposals for this request that the scheduler gave slots)
    the last of them are proposed tokens: the request's last token plus k proposals are the
    k + 1 query tokens whose logits verify the proposals (pagedllm/spec_decode)."""

    request: Request
    num_new_tokens: int
    block_table: list[int]
    spec_token_ids: list[int] = field(default_factory=list)

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
        return self.end == self.request.num_tokens + len(self.spec_token_ids)


@dataclass
class KVUpdate:
    """Every change a step makes to the KV tensors. Each rank (the runner, every tensor-parallel
    worker) applies it before the step's forward, in this order, each list as one batched move:

      1. ``resize``, if it grows the pool     (new blocks: elastic growth)
      2. ``compaction``  device -> device     (live blocks to the lowest ids; sources and
                                               destinations are disjoint)
      3. ``resize``, if it shrinks the pool   (the tail, free after compaction)
      4. ``swap_out``    device -> host       (preempted by swap; read before any write below)
      5. ``block_copies`` device -> device    (copy-on-write of shared partial blocks)
      6. ``swap_in``     host -> device       (into fresh blocks, possibly freed by 2-4)
      7. ``loads``       KV tier -> device    (payloads of verified blocks, into fresh blocks)
      8. ``lora_evictions``, then ``lora_loads``: LoRA adapters paged out of the pool (the
         runner forgets their device copies) and in (their weights written into fresh blocks;
         kv/adapters.py)

    Ids in 4-8 are the block ids after 1-3 (the KV manager decided them in that order).
    ``lora_pages``: where each adapter the step runs lives now (ids after 1-3): the runner reads
    an adapter's weights from its pages when it has no copy of them in a compute slot.
    """

    resize: int | None = None  # the device pool's size in blocks from this step on
    compaction: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) device ids
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) device ids
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    loads: list[tuple[Any, int]] = field(default_factory=list)  # (tier payload, device)
    lora_evictions: list[int] = field(default_factory=list)  # adapter ids paged out
    lora_loads: list[tuple[int, list[int]]] = field(default_factory=list)  # (adapter id, blocks)
    lora_pages: dict[int, list[int]] = field(default_factory=dict)  # the step's adapters' blocks

    @property
    def is_empty(self) -> bool:
        return (self.resize is None and not self.compaction and not self.swap_out
                and not self.block_copies and not self.swap_in and not self.loads
                and not self.lora_evictions and not self.lora_loads)


@dataclass
class SchedulerOutput:
    """One step's work: the KV changes (``kv``, applied first) and the forward of ``scheduled``.
    A step with nothing scheduled only changes the KV tensors (compaction, shrinking a pool)."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    kv: KVUpdate = field(default_factory=KVUpdate)

    @property
    def swap_out(self) -> list[tuple[int, int]]:
        return self.kv.swap_out

    @property
    def swap_in(self) -> list[tuple[int, int]]:
        return self.kv.swap_in

    @property
    def block_copies(self) -> list[tuple[int, int]]:
        return self.kv.block_copies

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
