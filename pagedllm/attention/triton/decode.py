"""Paged decode attention, split-K (flash-decoding).

Grid ``(num_decode_rows, Hkv, num_splits)``: program (i, h, s) attends the single query token of
decode request ``reqs[i]`` for the ``G = Hq / Hkv`` query heads of KV head h (GQA: each K/V tile
is loaded once for the whole group; the group is the M axis of ``tl.dot``, padded to >= 16 rows)
over key positions ``[s * split_len, (s + 1) * split_len) ∩ [0, seq_len)``::

    keys  0 ........................................ seq_len
          |-- split 0 --|-- split 1 --|-- split 2 --|
          tiles of TILE_N keys; key p lives at block_tables[req, p // block_size],
          offset p % block_size (a tile may span several small blocks or part of a large one)

Each program keeps an online softmax (running max m, sum l, accumulator acc) in fp32. With one
split it writes the output directly; otherwise it writes ``acc / l`` and ``lse = m + log2(l)`` per
split and ``_merge_kernel`` (grid ``(num_decode_rows, Hq)``) combines the splits:
``out = sum_s 2^(lse_s - max lse) * o_s / sum_s 2^(lse_s - max lse)``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

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
def _decode_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    k_scale_ptr,  # [num_blocks, block_size, Hkv] bf16 (used when K_QUANT)
    v_scale_ptr,  # (used when V_QUANT)
    out_ptr,  # [T, Hq, D] (one split) or partial out [R, Hq, S, BLOCK_D] fp32
    lse_ptr,  # [R, Hq, S] fp32 (several splits)
    reqs_ptr,  # [R] int32: request index of each decode row
    query_start_loc_ptr,  # [B+1] int32
    seq_lens_ptr,  # [B] int32
    block_tables_ptr,  # [B, max_blocks] int32
    scale_log2,  # softmax scale * log2(e)
    window,  # sliding window (used when USE_WINDOW)
    split_len,  # keys per split, a multiple of TILE_N
    stride_qt,
    stride_qh,
    stride_ot,  # out strides: token/row, head, (split)
    stride_oh,
    stride_os,
    stride_cb,
    stride_co,
    stride_ch,
    stride_sb,  # scale strides: block, offset, head
    stride_so,
    stride_sh,
    stride_bt,
    head_dim,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    SPLIT: tl.constexpr,  # write partials + lse instead of the output
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    K_QUANT: tl.constexpr = False,  # K is int8/fp8 values * per-token, per-head scales
    V_QUANT: tl.constexpr = False,
):
    i = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = tl.load(reqs_ptr + i)
    row = tl.load(query_start_loc_ptr + req)
    seq_len = tl.load(seq_lens_ptr + req)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)
    head = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < head_dim
    q = tl.load(
        q_ptr + row.to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [GROUP_PAD, BLOCK_D]
    if DOT_FP32:
        q = q.to(tl.float32)

    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    if USE_WINDOW:  # keys p > (seq_len - 1) - window
        lo = tl.maximum(lo, tl.maximum(seq_len - window, 0) // TILE_N * TILE_N)
    table = block_tables_ptr + req.to(tl.int64) * stride_bt

    m = tl.full([GROUP_PAD], -1.0e30, dtype=tl.float32)
    l = tl.zeros([GROUP_PAD], dtype=tl.float32)  # noqa: E741
    acc = tl.zeros([GROUP_PAD, BLOCK_D], dtype=tl.float32)
    for start in range(lo, hi, TILE_N):
        pos = start + tl.arange(0, TILE_N)
        k_mask = pos < seq_len
        if USE_WINDOW:
            k_mask = k_mask & (pos >= seq_len - window)
        k, v = load_kv_tile(  # [TILE_N, BLOCK_D] each
            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table, start, pos, k_mask,
            kv_head, d, d_mask, q, stride_cb, stride_co, stride_ch, stride_sb, stride_so,
            stride_sh, BLOCK_SIZE, TILE_N, DOT_FP32, K_QUANT, V_QUANT,
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [GROUP_PAD, TILE_N]
        s = tl.where(k_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    l_safe = tl.where(l > 0, l, 1.0)
    o = acc / l_safe[:, None]
    out_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:
        base = i.to(tl.int64) * stride_ot + head * stride_oh + split * stride_os
        tl.store(out_ptr + base[:, None] + d[None, :], o, mask=out_mask)
        lse = tl.where(l > 0, m + tl.log2(l_safe), float("-inf"))
        num_heads = tl.num_programs(1) * GROUP
        lse_off = (i.to(tl.int64) * num_heads + head) * tl.num_programs(2) + split  # [R, Hq, S]
        tl.store(lse_ptr + lse_off, lse, mask=g_mask)
    else:
        base = row.to(tl.int64) * stride_ot + head * stride_oh
        tl.store(
            out_ptr + base[:, None] + d[None, :], o.to(out_ptr.dtype.element_ty), mask=out_mask
        )


@triton.jit
def _merge_kernel(
    out_ptr,  # [T, Hq, D]
    part_ptr,  # [R, Hq, S, BLOCK_D] fp32
    lse_ptr,  # [R, Hq, S] fp32
    reqs_ptr,
    query_start_loc_ptr,
    stride_ot,
    stride_oh,
    num_splits,
    head_dim,
    SPLITS_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IN_ORDER: tl.constexpr = False,  # sum the splits one by one, in split order
):
    i = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.load(query_start_loc_ptr + tl.load(reqs_ptr + i))
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    base = i.to(tl.int64) * tl.num_programs(1) + head
    lse = tl.load(lse_ptr + base * num_splits + s, mask=s_mask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, axis=0))  # split 0 always holds keys: max is finite
    d_mask = d < head_dim
    if IN_ORDER:  # a split past the row's keys adds exact zeros: the sum ignores num_splits
        top = tl.max(lse, axis=0)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        den = 0.0
        for j in range(0, num_splits):
            w_j = tl.exp2(tl.load(lse_ptr + base * num_splits + j) - top)
            part_j = tl.load(part_ptr + (base * num_splits + j) * BLOCK_D + d, mask=d_mask,
                             other=0.0)
            acc += w_j * part_j
            den += w_j
        o = acc / den
    else:
        part = tl.load(
            part_ptr + (base * num_splits + s[:, None]) * BLOCK_D + d[None, :],
            mask=s_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # [SPLITS_PAD, BLOCK_D]
        o = tl.sum(w[:, None] * part, axis=0) / tl.sum(w, axis=0)
    tl.store(
        out_ptr + row.to(tl.int64) * stride_ot + head * stride_oh + d,
        o.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


class DecodeSplits(NamedTuple):
    """How the keys of a decode batch are split: ``num_splits`` ranges of ``split_len`` keys."""

    num_splits: int
    split_len: int

    @classmethod
    def choose(
        cls,
        num_rows: int,
        num_kv_heads: int,
        max_seq_len: int,
        tile_n: int,
        target_programs: int,
        min_split_len: int,
    ) -> DecodeSplits:
        """Enough splits for ``target_programs`` programs, none shorter than ``min_split_len``."""
        want = triton.cdiv(target_programs, max(1, num_rows * num_kv_heads))
        splits = max(1, min(want, max_seq_len // max(min_split_len, tile_n)))
        split_len = triton.cdiv(triton.cdiv(max_seq_len, splits), tile_n) * tile_n
        return cls(triton.cdiv(max_seq_len, split_len), split_len)

    @classmethod
    def fixed(cls, max_seq_len: int, split_len: int, tile_n: int) -> DecodeSplits:
        """Splits of ``split_len`` keys (rounded up to tiles) whatever the batch: a row's
        splits then depend on its own length alone (batch-invariant decode)."""
        split_len = triton.cdiv(split_len, tile_n) * tile_n
        return cls(max(1, triton.cdiv(max_seq_len, split_len)), split_len)


def decode_tile_n(head_dim: int) -> int:
    return 64 if next_pow2(head_dim) <= 128 else 32


def decode_attention(
    q: torch.Tensor,
    k_cache: KVCacheTensor,
    v_cache: KVCacheTensor,
    out: torch.Tensor,
    reqs: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    target_programs: int = 256,
    min_split_len: int = 256,
    fixed_split_len: int | None = None,
) -> None:
    """out[row] for the decode rows of requests ``reqs`` [R] int32 (query_len 1 each).

    q/out [T, Hq, D], caches [num_blocks, block_size, Hkv, D], metadata as in AttentionMetadata;
    ``max_seq_len`` bounds the decode requests' seq_lens (it sizes the split-K grid).
    ``fixed_split_len``: splits of that many keys whatever the batch, always merged, the splits
    summed in order (``DecodeSplits.fixed``): a row's bits do not depend on the other rows.
    """
    c = check_attention_call(q, k_cache, v_cache, out, reqs, block_tables)
    num_rows = reqs.shape[0]
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_rows == 0:
        return
    group = num_heads // num_kv_heads
    block_d = max(16, next_pow2(head_dim))
    tile_n = decode_tile_n(head_dim)
    if fixed_split_len is None:
        splits = DecodeSplits.choose(
            num_rows, num_kv_heads, max_seq_len, tile_n, target_programs, min_split_len
        )
    else:
        splits = DecodeSplits.fixed(max_seq_len, fixed_split_len, tile_n)
    dot_fp32, precision = dot_config(q.dtype)
    split = splits.num_splits > 1 or fixed_split_len is not None
    if split:  # partial outputs and their log-sum-exps, merged below
        dst = torch.empty(
            num_rows, num_heads, splits.num_splits, block_d, dtype=torch.float32, device=q.device
        )
        lse = torch.empty(dst.shape[:3], dtype=torch.float32, device=q.device)
        dst_strides = dst.stride()[:3]
    else:
        dst, lse, dst_strides = out, out, (out.stride(0), out.stride(1), 0)
    _decode_kernel[(num_rows, num_kv_heads, splits.num_splits)](
        q, c.k, c.v, c.k_scale, c.v_scale, dst, lse,
        reqs, query_start_loc, seq_lens, block_tables,
        scale * math.log2(math.e), sliding_window or 0, splits.split_len,
        q.stride(0), q.stride(1), *dst_strides,
        c.k.stride(0), c.k.stride(1), c.k.stride(2), *c.scale_strides,
        block_tables.stride(0), head_dim,
        GROUP=group, GROUP_PAD=max(16, next_pow2(group)), BLOCK_SIZE=block_size, TILE_N=tile_n,
        BLOCK_D=block_d, USE_WINDOW=sliding_window is not None, SPLIT=split,
        DOT_FP32=dot_fp32, PRECISION=precision, K_QUANT=c.k_quant, V_QUANT=c.v_quant,
    )
    if split:
        _merge_splits(out, dst, lse, reqs, query_start_loc, splits.num_splits, head_dim, block_d,
                      in_order=fixed_split_len is not None)


def _merge_splits(out: torch.Tensor, dst: torch.Tensor, lse: torch.Tensor, reqs: torch.Tensor,
                  query_start_loc: torch.Tensor, num_splits: int, head_dim: int, block_d: int,
                  in_order: bool) -> None:
    """out[row] = the split-K partials ``dst`` [R, Hq, splits, BLOCK_D] merged by their
    log-sum-exps ``lse``; ``in_order``: summed split by split (batch-invariant bits)."""
    _merge_kernel[(reqs.shape[0], out.shape[1])](
        out, dst, lse, reqs, query_start_loc, out.stride(0), out.stride(1), num_splits, head_dim,
        SPLITS_PAD=next_pow2(num_splits), BLOCK_D=block_d, IN_ORDER=in_order,
    )
