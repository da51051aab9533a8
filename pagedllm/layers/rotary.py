"""Rotary position embeddings (RoPE): default, linear, dynamic (NTK) and llama3 scaling.

Uses HF's rotate_half convention: the head dim is split into halves (x1 | x2), not interleaved
pairs; HF Llama checkpoints are already permuted for it. A cos|sin table of every position is
computed once in fp32 and indexed by the flat ``positions`` of a step.

Dynamic NTK differs from HF for positions >= max_position_embeddings. HF rescales the base for
the current sequence length and applies it to all positions of a forward; a paged cache rotates
each key once, when it is written. Here position p uses the base HF would use for a sequence of
p + 1 tokens, which equals HF's token-by-token decoding with a KV cache, and equals HF exactly
for sequences up to max_position_embeddings (the base is unscaled there). The table covers
max_position_embeddings * factor positions, as in vLLM.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedllm import kernels


def _inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """[D/2] fp32, computed the way HF does so that tables match bit for bit."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: low frequencies divided by factor, high kept, a smooth ramp between."""
    factor, low, high = (
        float(s["factor"]),
        float(s["low_freq_factor"]),
        float(s["high_freq_factor"]),
    )
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Holds the [max_positions, D] cos|sin table; ``forward(positions)`` looks rows up."""

    cos_sin_cache: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        max_position_embeddings: int,
        theta: float,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        self.theta = theta
        self.scaling: dict[str, Any] = dict(scaling or {})
        rope_type = self.scaling.get("rope_type", "default")
        if rope_type not in ("default", "linear", "dynamic", "llama3"):
            raise ValueError(
                f"rope type {rope_type!r} is not supported; supported: default, linear, dynamic, llama3"
            )
        self.rope_type = rope_type
        # linear and dynamic stretch the trained length by factor (vLLM sizes the table the same)
        stretch = float(self.scaling["factor"]) if rope_type in ("linear", "dynamic") else 1.0
        self.max_positions = int(max_position_embeddings * stretch)
        self.register_buffer("cos_sin_cache", self.compute_cache(), persistent=False)

    def compute_cache(self, device: torch.device | str | None = None) -> torch.Tensor:
        """[max_positions, D] fp32: cos of the D/2 angles, then their sin."""
        inv_freq = _inv_freq(self.head_dim, self.theta)
        pos = torch.arange(self.max_positions, dtype=torch.float32)
        if self.rope_type == "linear":
            inv_freq = inv_freq / float(self.scaling["factor"])
        elif self.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, self.scaling)
        freqs = pos[:, None] * inv_freq[None, :]  # [P, D/2]
        if self.rope_type == "dynamic":
            # Positions past the trained length: base scaled for a sequence of p + 1 tokens.
            factor, mpe, d = (
                float(self.scaling["factor"]),
                self.max_position_embeddings,
                self.head_dim,
            )
            long_pos = torch.arange(mpe, self.max_positions, dtype=torch.float64)
            base = self.theta * ((factor * (long_pos + 1) / mpe) - (factor - 1)) ** (d / (d - 2))
            exponent = torch.arange(0, d, 2, dtype=torch.float64) / d
            inv_long = (1.0 / base[:, None] ** exponent[None, :]).float()  # [P - mpe, D/2]
            freqs[mpe:] = pos[mpe:, None] * inv_long
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, 1, D/2] fp32, broadcasting over heads."""
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
        return cos, sin


def apply_rotary_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D] and k [T, Hk, D] rotated (``apply_rotary``); on CPU with the kernels built
    (and ``fused``), in place by one C++ op (``torch.ops.pagedllm.rotary_``, the same arithmetic
    bit for bit)."""
    if fused and kernels.fused(q, k, cos, sin):
        torch.ops.pagedllm.rotary_(q, k, cos, sin)
        return q, k
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] -> rotated, same dtype; computed in fp32. Equals HF's
    ``x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)``."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
