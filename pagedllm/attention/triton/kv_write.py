"""KV write: scatter the new K/V rows of a step into their paged cache slots.

One program per new token writes all of its KV heads, K and V, as one [Hkv, D] tile each::

    slot = slot_mapping[t]            block = slot // block_size, offset = slot % block_size
    k_cache[block, offset, :, :] = k[t]
    v_cache[block, offset, :, :] = v[t]

A quantized K or V (``QuantizedKV``) is quantized here, per head: ``scale = ceil_bf16(amax /
qmax)`` into the scale slot, ``floor(x / scale + 0.5)`` (int8) or ``x / scale`` cast (fp8) into
the value slot; IEEE divisions (``div_rn``), so the bits equal ``attention.quant.quantize``'s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.attention.quant import QMAX, KVCacheTensor
from pagedllm.attention.triton.common import INTERPRET, check_cache, next_pow2


@triton.jit
def _ceil_bf16(x):
    """fp32 x >= 0 rounded up to a bf16 value (returned as fp32; exact in bf16)."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0xFFFF) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _round_fp8(y, MANT: tl.constexpr, EMIN: tl.constexpr):
    """y (fp32, within the fp8 range) rounded to nearest-even on the fp8 grid of MANT mantissa
    bits and smallest normal exponent EMIN; the result converts to fp8 exactly. Used under
    TRITON_INTERPRET only: the interpreter's fp32 -> fp8 cast drops the rounding carry
    (124.2 -> 64 instead of 128 in e4m3) and flushes subnormals; GPU casts round correctly."""
    shift: tl.constexpr = 23 - MANT
    bits = y.to(tl.int32, bitcast=True)
    half = (1 << (shift - 1)) - 1 + ((bits >> shift) & 1)
    normal = ((bits + half) & -(1 << shift)).to(tl.float32, bitcast=True)
    big: tl.constexpr = 2.0 ** (EMIN - MANT + 23)  # its ulp is the subnormal step 2^(EMIN-MANT)
    sub = (tl.abs(y) + big) - big
    sub = tl.where(y < 0, -sub, sub)
    return tl.where(tl.abs(y) < 2.0**EMIN, sub, normal)


@triton.jit
def _quantize_store(x, cache_ptr, scale_ptr, dst, scale_dst, mask, h_mask, QMAX: tl.constexpr,
                    IS_INT: tl.constexpr, ROUND_FP8: tl.constexpr):
    """Quantize rows x [BLOCK_H, BLOCK_D] (fp32, zero where masked) with one scale per row."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-30)
    scale = _ceil_bf16(tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32)))
    y = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
    if IS_INT:
        y = tl.floor(y + 0.5)
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if ROUND_FP8 and not IS_INT:
        if QMAX == 448.0:  # e4m3
            y = _round_fp8(y, 3, -6)
        else:  # e5m2
            y = _round_fp8(y, 2, -14)
    tl.store(cache_ptr + dst, y.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + scale_dst, scale.to(scale_ptr.dtype.element_ty), mask=h_mask)


@triton.jit
def _kv_write_kernel(
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    k_scale_ptr,  # [num_blocks, block_size, Hkv] bf16 (if K_QMAX > 0)
    v_scale_ptr,  # (if V_QMAX > 0)
    slot_ptr,  # [T] int64
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,  # cache strides (K and V caches share them): block, offset, head
    stride_co,
    stride_ch,
    stride_sb,  # scale strides: block, offset, head
    stride_so,
    stride_sh,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,  # next_pow2(Hkv)
    BLOCK_D: tl.constexpr,  # next_pow2(D)
    K_QMAX: tl.constexpr = 0.0,  # 0: K is stored as is; else quantized with this qmax
    V_QMAX: tl.constexpr = 0.0,
    K_INT: tl.constexpr = False,  # int8 (round) rather than fp8 (cast)
    V_INT: tl.constexpr = False,
    ROUND_FP8: tl.constexpr = False,  # round to the fp8 grid in fp32 before the cast (interpreter)
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim)
    dst = block * stride_cb + offset * stride_co + h * stride_ch + d
    # Quantized KV: per-token, per-head scale, stored beside the slot
    heads = tl.arange(0, BLOCK_H)
    scale_dst = block * stride_sb + offset * stride_so + heads * stride_sh
    h_mask = heads < num_kv_heads
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask, other=0.0)
    if K_QMAX > 0:
        _quantize_store(k.to(tl.float32), k_cache_ptr, k_scale_ptr, dst, scale_dst, mask, h_mask,
                        K_QMAX, K_INT, ROUND_FP8)
    else:
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
    if V_QMAX > 0:
        _quantize_store(v.to(tl.float32), v_cache_ptr, v_scale_ptr, dst, scale_dst, mask, h_mask,
                        V_QMAX, V_INT, ROUND_FP8)
    else:
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: KVCacheTensor,
    v_cache: KVCacheTensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton version of ``attention.base.write_kv``: k/v [T, Hkv, D] into their slots
    (quantized into a ``QuantizedKV`` cache)."""
    c = check_cache(k_cache, v_cache)
    t, h, d = k.shape
    assert v.shape == k.shape and c.k.shape[2:] == (h, d), (k.shape, v.shape, c.k.shape)
    assert k.stride(2) == 1 and v.stride(2) == 1, "k/v need a contiguous last dim"
    assert slot_mapping.shape == (t,) and not slot_mapping.is_floating_point()
    if t == 0:
        return
    _kv_write_kernel[(t,)](
        k,
        v,
        c.k,
        c.v,
        c.k_scale,
        c.v_scale,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        c.k.stride(0),
        c.k.stride(1),
        c.k.stride(2),
        *c.scale_strides,
        h,
        d,
        BLOCK_SIZE=c.k.shape[1],
        BLOCK_H=next_pow2(h),
        BLOCK_D=next_pow2(d),
        K_QMAX=QMAX[c.k.dtype] if c.k_quant else 0.0,
        V_QMAX=QMAX[c.v.dtype] if c.v_quant else 0.0,
        K_INT=c.k.dtype == torch.int8,
        V_INT=c.v.dtype == torch.int8,
        ROUND_FP8=INTERPRET,
    )
