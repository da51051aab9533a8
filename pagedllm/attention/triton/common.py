"""Helpers shared by the Triton kernels and their wrappers: the paged K/V tile load, tile sizes,
checks, interpreter detection."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedllm.attention.quant import QMAX, KVCacheTensor, QuantizedKV

# Whether ``@triton.jit`` produced interpreted functions (TRITON_INTERPRET=1 when triton was first
# imported): the kernels then run in numpy on CPU tensors.
INTERPRET: bool = bool(triton.knobs.runtime.interpret) if hasattr(triton, "knobs") else False

# KV cache dtypes the attention kernels load directly; a QuantizedKV cache (int8 / fp8 values +
# bf16 scales, attention/quant.py) is dequantized on load where the kernels say "Quantized KV".
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


class CacheArgs(NamedTuple):
    """What the kernels take for a (k_cache, v_cache) pair: data tensors, scale tensors (the data
    tensor stands in, never read, for a cache that is not quantized), the scales' strides
    (block, offset, head; shared by K and V), and which of K, V is quantized."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    scale_strides: tuple[int, int, int]
    k_quant: bool
    v_quant: bool


def check_cache(k_cache: KVCacheTensor, v_cache: KVCacheTensor) -> CacheArgs:
    """The paged layout the kernels assume: [num_blocks, block_size, Hkv, D], D contiguous;
    K and V share strides; either may be quantized (scales [num_blocks, block_size, Hkv])."""
    k, v = _data(k_cache), _data(v_cache)
    assert k.dim() == 4, f"cache must be [num_blocks, block_size, Hkv, D], got {k.shape}"
    assert k.shape == v.shape and k.stride() == v.stride()
    for t in (k, v):
        if t.dtype not in KV_DTYPES and t.dtype not in QMAX:
            raise NotImplementedError(
                f"the triton backend reads KV caches of {KV_DTYPES} or int8/fp8 values with "
                f"scales (QuantizedKV), got {t.dtype}"
            )
        assert t.dtype in KV_DTYPES or isinstance(k_cache if t is k else v_cache, QuantizedKV), (
            f"a {t.dtype} cache needs its scales: pass a QuantizedKV"
        )
    assert k.stride(3) == 1, "cache head_dim must be contiguous"
    block_size = k.shape[1]
    assert block_size & (block_size - 1) == 0, f"block_size must be a power of two: {block_size}"
    ks = k_cache.scale if isinstance(k_cache, QuantizedKV) else None
    vs = v_cache.scale if isinstance(v_cache, QuantizedKV) else None
    strides: tuple[int, int, int] = (0, 0, 0)
    for sc in (ks, vs):
        if sc is not None:
            assert strides == (0, 0, 0) or strides == sc.stride(), "K/V scales must share strides"
            strides = (sc.stride(0), sc.stride(1), sc.stride(2))
    return CacheArgs(k, v, k if ks is None else ks, v if vs is None else vs, strides,
                     ks is not None, vs is not None)


def check_attention_call(q: torch.Tensor, k_cache: KVCacheTensor, v_cache: KVCacheTensor,
                         out: torch.Tensor, reqs: torch.Tensor,
                         block_tables: torch.Tensor) -> CacheArgs:
    """What the decode and prefill wrappers both check: q/out [T, Hq, D] with D contiguous, the
    caches' layout (``check_cache``), Hq a multiple of Hkv, int32 request indices and tables."""
    c = check_cache(k_cache, v_cache)
    _, num_heads, head_dim = q.shape
    assert num_heads % k_cache.shape[2] == 0 and k_cache.shape[3] == head_dim
    assert q.stride(2) == 1 and out.stride(2) == 1 and out.shape == q.shape
    assert reqs.dtype == torch.int32 and block_tables.dtype == torch.int32
    return c


def _data(cache: KVCacheTensor) -> torch.Tensor:
    return cache.data if isinstance(cache, QuantizedKV) else cache


@triton.jit
def load_kv_tile(
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    k_scale_ptr,  # [num_blocks, block_size, Hkv] bf16 (read when K_QUANT)
    v_scale_ptr,  # (read when V_QUANT)
    table,  # this request's row of the block table
    start,  # first key position of the tile
    pos,  # [TILE_N] key positions start ... start + TILE_N - 1
    k_mask,  # [TILE_N] which keys to load
    kv_head,
    d,  # [BLOCK_D] arange
    d_mask,
    q,  # the query tile: K/V come back in its dtype
    stride_cb,
    stride_co,
    stride_ch,
    stride_sb,
    stride_so,
    stride_sh,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    K_QUANT: tl.constexpr,
    V_QUANT: tl.constexpr,
):
    """K and V of TILE_N consecutive key positions of one KV head, [TILE_N, BLOCK_D] each, read
    in place through the block table (key p at block table[p // BLOCK_SIZE], offset
    p % BLOCK_SIZE; a tile may span several small blocks or part of a large one). Quantized KV is
    dequantized on load: value * its token's, head's scale, in fp32, then to q's dtype."""
    if BLOCK_SIZE >= TILE_N:  # the tile lies inside one block
        block = tl.load(table + start // BLOCK_SIZE).to(tl.int64)
    else:
        block = tl.load(table + pos // BLOCK_SIZE, mask=k_mask, other=0).to(tl.int64)
    row_off = block * stride_cb + (pos % BLOCK_SIZE) * stride_co
    kv_off = row_off[:, None] + kv_head * stride_ch + d[None, :]
    kv_mask = k_mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
    scale_off = block * stride_sb + (pos % BLOCK_SIZE) * stride_so + kv_head * stride_sh
    if K_QUANT:
        ks = tl.load(k_scale_ptr + scale_off, mask=k_mask, other=0.0).to(tl.float32)
        k = (k.to(tl.float32) * ks[:, None]).to(q.dtype)
    if V_QUANT:
        vs = tl.load(v_scale_ptr + scale_off, mask=k_mask, other=0.0).to(tl.float32)
        v = (v.to(tl.float32) * vs[:, None]).to(q.dtype)
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v
