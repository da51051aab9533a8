"""Helpers shared by the Triton kernels' wrappers: tile sizes, checks, interpreter detection."""

from __future__ import annotations

import torch
import triton

# Whether ``@triton.jit`` produced interpreted functions (TRITON_INTERPRET=1 when triton was first
# imported): the kernels then run in numpy on CPU tensors.
INTERPRET: bool = bool(triton.knobs.runtime.interpret) if hasattr(triton, "knobs") else False

# KV cache dtypes the attention kernels load directly. Quantized KV (int8/fp8 + scales) is a
# separate piece of work: it adds a dequantize-on-load where the kernels say "Quantized KV hook".
KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def dot_config(dtype: torch.dtype) -> tuple[bool, str]:
    """(upcast operands to fp32 before ``tl.dot``, the dot's ``input_precision``).

    fp32 inputs use "ieee" (no TF32 rounding: the results match torch_ref to ~1e-6).
    The interpreter's bf16 ``tl.dot`` is broken, so bf16 is upcast to fp32 there.
    """
    upcast = dtype == torch.float32 or (INTERPRET and dtype == torch.bfloat16)
    return upcast, "ieee" if upcast else "tf32"


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The paged layout the kernels assume: [num_blocks, block_size, Hkv, D], D contiguous."""
    assert k_cache.dim() == 4, (
        f"cache must be [num_blocks, block_size, Hkv, D], got {k_cache.shape}"
    )
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.dtype == v_cache.dtype
    if k_cache.dtype not in KV_DTYPES:
        raise NotImplementedError(
            f"the triton backend reads KV caches of {KV_DTYPES}, got {k_cache.dtype}; quantized "
            f"KV (int8/fp8, dequantize-on-load) is not built yet"
        )
    assert k_cache.stride(3) == 1, "cache head_dim must be contiguous"
    block_size = k_cache.shape[1]
    assert block_size & (block_size - 1) == 0, f"block_size must be a power of two: {block_size}"
