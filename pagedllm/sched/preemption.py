"""How a preempted request leaves the device: by recompute or by swap, and what each costs.

``choose_preemption`` decides for one victim under ``preemption_mode``; ``PreemptionCost`` is the
estimate ``preemption_mode="auto"`` compares. The queue moves are the scheduler's own
(``Scheduler._preempt``). Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig


@dataclass(frozen=True)
class PreemptionCost:
    """Rough cost model: recomputing ``t`` tokens costs ``flops_per_token * t / flops_per_s``
    seconds; swapping ``b`` blocks out and back costs ``2 * b * bytes_per_block / bytes_per_s``.
    The engine fills it from the model size and device; the defaults fit a small model on CPU."""

    flops_per_token: float = 2e8
    bytes_per_block: float = 2**17
    flops_per_s: float = 5e10
    bytes_per_s: float = 5e9

    @classmethod
    def for_engine(cls, config: EngineConfig, bytes_per_block: int) -> PreemptionCost:
        """The engine's estimate: 2 FLOPs per weight per token against host<->device bandwidth
        (assumed throughputs: CPU 5e10 FLOP/s and 5e9 B/s; CUDA 5e13 FLOP/s and 1.2e10 B/s over
        PCIe)."""
        m = config.model
        q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
        per_layer = m.hidden_size * (2 * q + 2 * kv) + 3 * m.hidden_size * m.intermediate_size
        params = m.num_hidden_layers * per_layer + m.vocab_size * m.hidden_size
        cuda = config.is_cuda
        return cls(2.0 * params, float(bytes_per_block), 5e13 if cuda else 5e10,
                   1.2e10 if cuda else 5e9)

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
