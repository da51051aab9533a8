"""Batch-invariant Triton kernels for CUDA (``--batch-invariant`` with the triton attention
backend): the linear layers' GEMM, RMSNorm (with the residual add in front) and the row softmax.

A row's bits must not depend on how many rows run beside it. What makes them depend on it on a
GPU is a reduction whose order follows the batch: cuBLAS picks a kernel (tile, split-K, stream-K)
by M; a norm or softmax kernel may pick its block by the tensor's shape. Here each output is one
reduction in one fixed order, whatever the batch:

- ``matmul``: one tile shape (``TILE``) for every M, no split-K; each output is one fp32
  accumulation over K in ``BLOCK_K`` steps (``tl.dot``'s rows are independent), then the bias.
  M is never specialised (``do_not_specialize``), so a CUDA graph's padded rows and a 1-row
  call run the same compiled kernel. fp32 operands take ``input_precision="ieee"`` (no TF32).
- ``rms_norm`` / ``add_rms_norm_``: one program per row, the whole row in one block whose size
  follows the hidden size alone; HF's rounding points (RMSNorm in fp32, the residual sum and the
  normalised row rounded to the input dtype, then times the weight).
- ``softmax``: one program per row, over the vocabulary in ``SOFTMAX_BLOCK`` chunks (per-lane
  running max and sum, reduced once at the end).

Tested in Triton's interpreter on CPU tensors (tests/layers/test_triton_invariant_ops.py): a row
has the same bits alone and amid other rows, and the results match torch. They have not yet run
compiled on a GPU (scripts/gpu_check.sh, step ``invariant``, runs the same tests there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.attention.triton.common import INTERPRET, next_pow2

TILE = (64, 64, 32)  # (BLOCK_M, BLOCK_N, BLOCK_K) of every matmul call, whatever M
SOFTMAX_BLOCK = 1024
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _cast(x, dtype: tl.constexpr, ROUND: tl.constexpr):
    """fp32 x to ``dtype``; ``ROUND``: round to nearest even by hand first (the interpreter's
    fp32 -> bf16 cast truncates; a GPU's rounds)."""
    if ROUND:
        b = x.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        x = b.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                   HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                   ROUND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :],
                    mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rn[None, :] * stride_wn + rk[:, None],  # [BLOCK_K, BLOCK_N] of W.T
                    mask=(rn[None, :] < N) & (rk[:, None] < K), other=0.0)
        if UPCAST:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :],
             _cast(acc, y_ptr.dtype.element_ty, ROUND),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K].T (+ bias [N]) -> [M, N] in x's dtype; row i's bits depend on
    x[i], w and bias alone."""
    assert x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1], (x.shape, w.shape)
    assert x.dtype == w.dtype and x.dtype in DTYPES, (x.dtype, w.dtype)
    assert bias is None or (bias.shape == (w.shape[0],) and bias.is_contiguous())
    x, w = x.contiguous(), w.contiguous()
    (m, k), n = x.shape, w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    bm, bn, bk = TILE
    # the interpreter's bf16 / fp16 dot is broken: fp32 there (as the attention kernels do)
    upcast = x.dtype == torch.float32 or INTERPRET
    _matmul_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x, w, x if bias is None else bias, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, UPCAST=upcast, PRECISION="ieee" if upcast else "tf32",
        ROUND=_round(x.dtype),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=4)
    return y


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, H, stride_x, stride_r, stride_y, eps,
                     ADD: tl.constexpr, ROUND: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    h = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + h, mask=h < H, other=0.0)
    dtype = x.dtype
    if ADD:  # residual <- x + residual, rounded to the dtype, and normalised
        x = _cast(x.to(tl.float32) + tl.load(r_ptr + row * stride_r + h, mask=h < H, other=0.0)
                  .to(tl.float32), dtype, ROUND)
        tl.store(r_ptr + row * stride_r + h, x, mask=h < H)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(xf * xf, axis=0) / H + eps)
    normed = _cast(xf * rstd, dtype, ROUND).to(tl.float32)
    w = tl.load(w_ptr + h, mask=h < H, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + h, _cast(w * normed, y_ptr.dtype.element_ty, ROUND),
             mask=h < H)


def _round(dtype: torch.dtype) -> bool:
    return INTERPRET and dtype == torch.bfloat16


def _check_rows(*ts: torch.Tensor) -> None:
    for t in ts:
        assert t.dim() == 2 and t.stride(-1) == 1 and t.dtype in DTYPES, (t.shape, t.stride())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x [T, H] (as ``RMSNorm._norm``), one row per program."""
    _check_rows(x)
    y = torch.empty_like(x)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](x, x, weight, y, x.shape[1], x.stride(0), x.stride(0),
                                        y.stride(0), eps, ADD=False, ROUND=_round(x.dtype),
                                        BLOCK=next_pow2(x.shape[1]))
    return y


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> None:
    """residual <- x + residual; x <- RMSNorm(residual), in place (as the fused CPU op)."""
    _check_rows(x, residual)
    assert x.shape == residual.shape and x.dtype == residual.dtype
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](x, residual, weight, x, x.shape[1], x.stride(0),
                                        residual.stride(0), x.stride(0), eps, ADD=True,
                                        ROUND=_round(x.dtype), BLOCK=next_pow2(x.shape[1]))


@triton.jit
def _softmax_kernel(x_ptr, y_ptr, V, stride_x, stride_y, LOG: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    m = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK):
        x = tl.load(x_ptr + row * stride_x + v0 + lanes, mask=v0 + lanes < V,
                    other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        # a lane that has seen only -inf keeps sum 0 (no NaN from -inf - -inf)
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - safe) + tl.exp(x - safe)
        m = m_new
    top = tl.max(m, axis=0)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(s * tl.exp(m - top_safe), axis=0)
    for v0 in range(0, V, BLOCK):
        x = tl.load(x_ptr + row * stride_x + v0 + lanes, mask=v0 + lanes < V,
                    other=float("-inf")).to(tl.float32)
        if LOG:
            y = x - top_safe - tl.log(total)
        else:
            y = tl.exp(x - top_safe) / total
        tl.store(y_ptr + row * stride_y + v0 + lanes, y, mask=v0 + lanes < V)


def softmax(x: torch.Tensor, log: bool = False) -> torch.Tensor:
    """softmax (``log``: log_softmax) over the last dim of x [B, V], fp32, one row per program."""
    _check_rows(x)
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if x.shape[0]:
        _softmax_kernel[(x.shape[0],)](x, y, x.shape[1], x.stride(0), y.stride(0), LOG=log,
                                       BLOCK=SOFTMAX_BLOCK)
    return y
