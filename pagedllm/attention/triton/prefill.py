"""Paged prefill / chunked-prefill attention.

Grid ``(cdiv(max_query_len, BLOCK_Q), num_prefill_reqs, Hkv)``: program (t, j, h) takes query
tokens ``[t * BLOCK_Q, (t + 1) * BLOCK_Q)`` of the new chunk of request ``reqs[j]`` together with
all ``G = Hq / Hkv`` query heads of KV head h, folded into one M axis of ``BLOCK_M`` rows::

    row r  ->  token t * BLOCK_Q + r // G,  query head h * G + r % G     (BLOCK_Q = BLOCK_M // G)

so each K/V tile is loaded once per group. It walks key tiles of TILE_N positions from the first
key any of its queries can see (0, or the sliding window's start) up to its last query's position,
with an fp32 online softmax. The new chunk sits at positions ``seq_len - query_len ..
seq_len - 1``; cached context is seen in full, the chunk causally (``key_pos <= q_pos``), and with
a window only ``key_pos > q_pos - window``. Programs past a request's chunk exit at once.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pagedllm.attention.quant import KVCacheTensor
from pagedllm.attention.triton.common import (
    check_attention_call,
    dot_config,
    load_kv_tile,
    next_pow2,
)


@triton.jit
def _prefill_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    k_scale_ptr,  # [num_blocks, block_size, Hkv] bf16 (used when K_QUANT)
    v_scale_ptr,  # (used when V_QUANT)
    out_ptr,  # [T, Hq, D]
    reqs_ptr,  # [P] int32: request index of each prefill request
    query_start_loc_ptr,  # [B+1] int32
    seq_lens_ptr,  # [B] int32
    block_tables_ptr,  # [B, max_blocks] int32
    scale_log2,  # softmax scale * log2(e)
    window,  # sliding window (used when USE_WINDOW)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_co,
    stride_ch,
    stride_sb,  # scale strides: block, offset, head
    stride_so,
    stride_sh,
    stride_bt,
    head_dim,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # BLOCK_M // GROUP
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    K_QUANT: tl.constexpr = False,  # K is int8/fp8 values * per-token, per-head scales
    V_QUANT: tl.constexpr = False,
):
    tile = tl.program_id(0)
    req = tl.load(reqs_ptr + tl.program_id(1))
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if tile * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - query_len

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    tok = tile * BLOCK_Q + r // GROUP  # [BLOCK_M] token index within the chunk
    head = kv_head * GROUP + r % GROUP
    r_mask = (r < BLOCK_Q * GROUP) & (tok < query_len)
    d_mask = d < head_dim
    q_pos = context_len + tok
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=r_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    if DOT_FP32:
        q = q.to(tl.float32)

    hi = tl.minimum(seq_len, context_len + (tile + 1) * BLOCK_Q)  # past the tile's last query
    lo = 0
    if USE_WINDOW:  # the tile's first query sees keys > its position - window
        lo = tl.maximum(context_len + tile * BLOCK_Q - window + 1, 0) // TILE_N * TILE_N
    table = block_tables_ptr + req.to(tl.int64) * stride_bt

    m = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)  # noqa: E741
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(lo, hi, TILE_N):
        pos = start + tl.arange(0, TILE_N)
        k_mask = pos < seq_len
        if USE_WINDOW:  # keys before the tile's window are not even loaded (freed blocks)
            k_mask = k_mask & (pos > context_len + tile * BLOCK_Q - window)
        k, v = load_kv_tile(  # [TILE_N, BLOCK_D] each
            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table, start, pos, k_mask,
            kv_head, d, d_mask, q, stride_cb, stride_co, stride_ch, stride_sb, stride_so,
            stride_sh, BLOCK_SIZE, TILE_N, DOT_FP32, K_QUANT, V_QUANT,
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_M, TILE_N]
        keep = (pos[None, :] <= q_pos[:, None]) & k_mask[None, :]
        if USE_WINDOW:
            keep = keep & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    o = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=r_mask[:, None] & d_mask[None, :],
    )


def prefill_tiles(head_dim: int, group: int) -> tuple[int, int]:
    """(BLOCK_M query rows, TILE_N keys) per program: smaller tiles for D = 256."""
    big = next_pow2(head_dim) <= 128
    return max(64 if big else 32, next_pow2(group)), 64 if big else 32


def prefill_attention(
    q: torch.Tensor,
    k_cache: KVCacheTensor,
    v_cache: KVCacheTensor,
    out: torch.Tensor,
    reqs: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
) -> None:
    """out rows of the new chunks of requests ``reqs`` [P] int32 (any query_len >= 1).

    ``max_query_len`` bounds their query lengths (it sizes the grid).
    """
    c = check_attention_call(q, k_cache, v_cache, out, reqs, block_tables)
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if reqs.shape[0] == 0:
        return
    group = num_heads // num_kv_heads
    block_m, tile_n = prefill_tiles(head_dim, group)
    block_q = block_m // group
    dot_fp32, precision = dot_config(q.dtype)
    grid = (triton.cdiv(max_query_len, block_q), reqs.shape[0], num_kv_heads)
    _prefill_kernel[grid](
        q,
        c.k,
        c.v,
        c.k_scale,
        c.v_scale,
        out,
        reqs,
        query_start_loc,
        seq_lens,
        block_tables,
        scale * math.log2(math.e),
        sliding_window or 0,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        c.k.stride(0),
        c.k.stride(1),
        c.k.stride(2),
        *c.scale_strides,
        block_tables.stride(0),
        head_dim,
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        BLOCK_D=max(16, next_pow2(head_dim)),
        USE_WINDOW=sliding_window is not None,
        DOT_FP32=dot_fp32,
        PRECISION=precision,
        K_QUANT=c.k_quant,
        V_QUANT=c.v_quant,
    )
