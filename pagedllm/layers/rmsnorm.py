"""RMSNorm, computed in fp32 like HF's LlamaRMSNorm; with the residual add fused in front of it
(``add_norm``) the way a decoder layer uses it.

On CPU both run as one C++ op each (``torch.ops.pagedllm.rms_norm`` / ``add_rms_norm_``,
pagedllm/kernels/csrc/elementwise.cpp) when the kernels are built; in batch-invariant mode on
the Triton family as its row-per-program kernel (layers/triton_invariant.py); elsewhere, or
without them, as the torch ops below. Same rounding points either way: the residual sum and
the normalised row are rounded to the input dtype, then multiplied by the weight.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm import kernels


class RMSNorm(nn.Module):
    fused = True  # may run the fused CPU ops (kernels.set_fused_ops turns it off per model)
    invariant = False  # the batch-invariant Triton kernel (linear.use_triton_invariant)

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        if self.invariant:
            from pagedllm.layers import triton_invariant

            return triton_invariant.rms_norm(x.contiguous(), self.weight, self.eps)
        if (self.fused and x.dim() == 2 and x.dtype == self.weight.dtype
                and kernels.fused(x, self.weight)):
            return torch.ops.pagedllm.rms_norm(x, self.weight, self.eps)
        return self._norm(x)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); may overwrite x and residual with them."""
        if self.invariant:
            from pagedllm.layers import triton_invariant

            x, residual = x.contiguous(), residual.contiguous()
            triton_invariant.add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        if (self.fused and x.dim() == 2 and x.dtype == residual.dtype == self.weight.dtype
                and kernels.fused(x, residual, self.weight)):
            torch.ops.pagedllm.add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
