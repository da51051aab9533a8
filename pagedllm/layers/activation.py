"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import kernels


class SiluAndMul(nn.Module):
    """[..., 2 * I] (gate | up) -> silu(gate) * up, [..., I]; on CPU one C++ op
    (``torch.ops.pagedllm.silu_and_mul``) when the kernels are built."""

    fused = True  # may run the fused CPU op (kernels.set_fused_ops turns it off per model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.dim() == 2 and kernels.fused(x):
            return torch.ops.pagedllm.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
