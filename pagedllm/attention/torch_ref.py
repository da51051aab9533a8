"""The ground-truth attention backend: one request at a time, plain masked softmax in fp32.

Every fast backend is tested against this one. It reads exactly the cached tokens a request's
queries can see (never a padded slot, and with a sliding window nothing before the first query's
window), so it is also the reference for what "correct" means when a block holds stale data past
the end of a sequence, or a table entry before the window names a block freed for another
request (kv/window.py). A quantized cache is dequantized to fp32
on gather, so this is also the reference for what the other backends must compute over it.
"""

from __future__ import annotations

import torch

from pagedllm.attention.base import AttentionBackend, AttentionMetadata, write_kv
from pagedllm.attention.quant import KVCacheTensor, load_blocks


def gather_kv(
    cache: KVCacheTensor, block_table: torch.Tensor, seq_len: int, start: int = 0
) -> torch.Tensor:
    """Cached rows ``start .. seq_len - 1`` of one request: [seq_len - start, Hkv, D] (fp32 if
    quantized); blocks before ``start``'s are not read.

    block_table = [7, 2, 9]   block_size = 4   seq_len = 10   start = 5
    positions 4..7 -> block 2, 8..9 -> block 9 (offsets 0, 1); rows 5..9 returned
    """
    _, block_size, h, d = cache.shape
    first, num_blocks = start // block_size, -(-seq_len // block_size)
    blocks = block_table[first:num_blocks].long()
    rows = load_blocks(cache, blocks).reshape((num_blocks - first) * block_size, h, d)
    return rows[start - first * block_size : seq_len - first * block_size]


def window_start(query_len: int, seq_len: int, sliding_window: int | None) -> int:
    """The first key position any of the last ``query_len`` queries may attend."""
    if sliding_window is None:
        return 0
    return max(0, seq_len - query_len - sliding_window + 1)


def attention_mask(
    query_len: int, seq_len: int, sliding_window: int | None, device: torch.device,
    start: int = 0,
) -> torch.Tensor:
    """Bool [query_len, seq_len - start], True where query row t (at position seq_len -
    query_len + t) may attend key position ``start + j``: causal, and (a query at p sees keys
    > p - sliding_window, itself included, as transformers' sliding_window_overlay) within the
    last ``sliding_window`` positions."""
    q_pos = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
    k_pos = torch.arange(start, seq_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


class TorchRefBackend(AttentionBackend):
    name = "torch_ref"
    supports_quantized_kv = True

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: KVCacheTensor,
        v_cache: KVCacheTensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
        group = num_heads // num_kv_heads
        out = torch.empty_like(q)
        for i in range(meta.num_reqs):
            start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
            seq_len = meta.seq_lens_cpu[i]
            if end == start:
                continue
            qi = q[start:end].float()  # [n, Hq, D]
            first = window_start(end - start, seq_len, sliding_window)
            ki = gather_kv(k_cache, meta.block_tables[i], seq_len, first).float()  # [L, Hkv, D]
            vi = gather_kv(v_cache, meta.block_tables[i], seq_len, first).float()
            ki = ki.repeat_interleave(group, dim=1)  # [L, Hq, D]
            vi = vi.repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", qi, ki) * scale  # [Hq, n, L]
            mask = attention_mask(end - start, seq_len, sliding_window, q.device, first)
            scores = scores.masked_fill(~mask, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[start:end] = torch.einsum("hqk,khd->qhd", probs, vi).to(q.dtype)
        return out
