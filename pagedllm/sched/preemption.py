"""How a preempted request leaves the device: by recompute or by swap, and what each costs.

``choose_preemption`` decides for one victim under ``preemption_mode``; ``PreemptionCost`` is the
estimate ``preemption_mode="auto"`` compares. The queue moves are the scheduler's own
(``Scheduler._preempt``). Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PreemptionCost:
    """Rough cost model: recomputing ``t`` tokens costs ``flops_per_token * t / flops_per_s``
    seconds; swapping ``b`` blocks out and back costs ``2 * b * bytes_per_block / bytes_per_s``.
    The engine fills it from the model size and device; the defaults fit a small model on CPU."""

    flops_per_token: float = 2e8
    bytes_per_block: float = 2**17
    flops_per_s: float = 5e10
    bytes_per_s: float = 5e9

    def recompute_s(self, num_tokens: int) -> float:
        return self.flops_per_token * num_tokens / self.flops_per_s

    def swap_s(self, num_blocks: int) -> float:
        return 2 * num_blocks * self.bytes_per_block / self.bytes_per_s


def choose_preemption(mode: str, cost: PreemptionCost, num_computed_tokens: int,
                      num_blocks: int, num_free_host_blocks: int) -> tuple[str, str]:
    """("swap" | "recompute", why) for one victim under ``preemption_mode``."""
    if mode == "recompute":
        return "recompute", "preemption_mode=recompute"
    if num_blocks > num_free_host_blocks:
        return "recompute", (f"host tier has {num_free_host_blocks} free blocks, "
                             f"victim holds {num_blocks}")
    if mode == "swap":
        return "swap", "preemption_mode=swap"
    rec, swp = cost.recompute_s(num_computed_tokens), cost.swap_s(num_blocks)
    how = "swap" if swp < rec else "recompute"
    return how, (f"auto: recompute {num_computed_tokens} tokens ~{rec * 1e3:.3f} ms vs swap "
                 f"{num_blocks} blocks out+in ~{swp * 1e3:.3f} ms")
