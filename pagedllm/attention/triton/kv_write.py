"""KV write: scatter the new K/V rows of a step into their paged cache slots.

One program per new token writes all of its KV heads, K and V, as one [Hkv, D] tile each::

    slot = slot_mapping[t]            block = slot // block_size, offset = slot % block_size
    k_cache[block, offset, :, :] = k[t]
    v_cache[block, offset, :, :] = v[t]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.attention.triton.common import check_cache, next_pow2


@triton.jit
def _kv_write_kernel(
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    slot_ptr,  # [T] int64
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,  # cache strides (K and V caches share them): block, offset, head
    stride_co,
    stride_ch,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,  # next_pow2(Hkv)
    BLOCK_D: tl.constexpr,  # next_pow2(D)
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim)
    dst = block * stride_cb + offset * stride_co + h * stride_ch + d
    # Quantized KV (int8/fp8) hook: quantize here (per-token, per-head scale = amax / qmax over
    # d, stored next to the slot) instead of the plain cast. Not built yet.
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton version of ``attention.base.write_kv``: k/v [T, Hkv, D] into their slots."""
    check_cache(k_cache, v_cache)
    t, h, d = k.shape
    assert v.shape == k.shape and k_cache.shape[2:] == (h, d), (k.shape, v.shape, k_cache.shape)
    assert k.stride(2) == 1 and v.stride(2) == 1, "k/v need a contiguous last dim"
    assert slot_mapping.shape == (t,) and not slot_mapping.is_floating_point()
    if t == 0:
        return
    _kv_write_kernel[(t,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        h,
        d,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=next_pow2(h),
        BLOCK_D=next_pow2(d),
    )
