"""The mixed-adapter LoRA delta on CUDA: two Triton kernels, Punica's BGMV shape (one program per
token and output tile, each token reading its own adapter's slot)::

    shrink   h[t, :]              = A[slot[t]] @ x[t]          A [S+1, n*R, in]   h [T, n*R]
    expand   y[t, off_j + o]     += B_j[slot[t]] @ h[t, jR:(j+1)R]   B_j [S+1, out_j, R]

The base model's tokens point at slot S, all zeros, and add nothing. Accumulation in fp32.
``LoRAMapping.method`` "triton" (lora/ops.py) runs them; the engine picks it on CUDA, and its
decode CUDA graphs record them (runner/cuda_graph.py). Tested against the per-token reference
(``tests/lora/test_lora_triton.py``): in Triton's interpreter on CPU tensors, and compiled on an
H200 (``TRITON_INTERPRET=0``); timed there in docs/features/lora.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 32  # output rows per program
BLOCK_K = 64  # input columns per loop iteration (shrink)


@triton.jit
def _shrink(x_ptr, a_ptr, slot_ptr, h_ptr, K, N,
            stride_xt, stride_as, stride_an, stride_ht,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    s = tl.load(slot_ptr + t)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(x_ptr + t * stride_xt + k, mask=k < K, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + s * stride_as + n[:, None] * stride_an + k[None, :],
                    mask=(n[:, None] < N) & (k[None, :] < K), other=0.0).to(tl.float32)
        acc += tl.sum(a * xk[None, :], axis=1)
    tl.store(h_ptr + t * stride_ht + n, acc, mask=n < N)


@triton.jit
def _expand(h_ptr, b_ptr, slot_ptr, y_ptr, R, N, h_col, y_col,
            stride_ht, stride_bs, stride_bo, stride_yt,
            BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0)
    o = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_R)
    s = tl.load(slot_ptr + t)
    hr = tl.load(h_ptr + t * stride_ht + h_col + r, mask=r < R, other=0.0)
    b = tl.load(b_ptr + s * stride_bs + o[:, None] * stride_bo + r[None, :],
                mask=(o[:, None] < N) & (r[None, :] < R), other=0.0).to(tl.float32)
    delta = tl.sum(b * hr[None, :], axis=1)
    y = y_ptr + t * stride_yt + y_col + o
    tl.store(y, (tl.load(y, mask=o < N, other=0.0).to(tl.float32) + delta).to(y.dtype.element_ty),
             mask=o < N)


def shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """h [T, n*R] (fp32) = A[slots[t]] @ x[t] for every token."""
    x, a = x.contiguous(), a.contiguous()
    t, k = x.shape
    n = a.shape[1]
    h = torch.empty(t, n, dtype=torch.float32, device=x.device)
    if t:
        _shrink[(t, triton.cdiv(n, BLOCK_N))](x, a, slots, h, k, n, x.stride(0), a.stride(0),
                                               a.stride(1), h.stride(0),
                                               BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return h


def expand(h: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, y: torch.Tensor,
           h_col: int, y_col: int) -> None:
    """y[t, y_col:y_col+out] += B[slots[t]] @ h[t, h_col:h_col+R], in place (``y`` row-contiguous)."""
    b = b.contiguous()
    t = h.shape[0]
    out, rank = b.shape[1], b.shape[2]
    assert y.stride(1) == 1, "y's rows must be contiguous"
    if t:
        _expand[(t, triton.cdiv(out, BLOCK_N))](h, b, slots, y, rank, out, h_col, y_col,
                                                h.stride(0), b.stride(0), b.stride(1), y.stride(0),
                                                BLOCK_N=BLOCK_N, BLOCK_R=triton.next_power_of_2(rank))


__all__ = ["expand", "shrink"]
