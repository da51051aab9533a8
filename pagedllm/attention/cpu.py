"""The fast CPU attention backend.

Decode tokens (query_len == 1) of consecutive requests are batched into one SDPA call over their
gathered blocks, in groups whose gathered K stays under ``decode_group_bytes`` (see below); each
prefill chunk is one SDPA call over its request's gathered context. GQA never materialises
repeated K/V: decode folds the query group into the query-length axis, prefill uses
``enable_gqa``. Everything is computed in fp32 and cast back to q's dtype.

Why groups, not one batched call: on CPU the batched gather ``k_cache[block_tables]`` of long
contexts is a large fresh allocation per layer, and measured 2-3x slower than attending request by
request (64 requests x 1024 tokens: batched 222 ms, per request 65 ms); for short contexts
batching wins (64 x 32 tokens: per request 3.3 ms, groups of 256 KiB 2.3 ms). Grouping up to
``decode_group_bytes`` of gathered K gets the better of both (1 thread, busy machine, noisy).

Invariant required of the caller: every cache slot holds finite values (allocate the KV cache
with ``torch.zeros``, not ``torch.empty``). Batched decode reads the unused tail of each request's
last block and the zero-padded block-table entries; they are masked out, but NaN/Inf there would
still leak through ``0 * NaN``. Stale K/V of freed blocks is fine.

Quantized KV (``QuantizedKV`` caches) is dequantized to fp32 right after the block gather
(``load_blocks``), so the SDPA calls are the same as for an fp32 cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.base import AttentionBackend, AttentionMetadata, write_kv
from pagedllm.attention.quant import KVCacheTensor, load_blocks


class CpuBackend(AttentionBackend):
    name = "cpu"
    supports_quantized_kv = True
    decode_group_bytes: int = 1 << 18

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
        assert q.dim() == 3 and k.dim() == 3 and k_cache.dim() == 4, "q/k/v [T, H, D], cache 4-D"
        assert q.shape[1] % k_cache.shape[2] == 0 and q.shape[2] == k_cache.shape[3]
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        row_bytes = k_cache.shape[2] * k_cache.shape[3] * 4
        group: list[int] = []  # consecutive decode requests, attended in one call
        group_max = 0
        for i in range(meta.num_reqs + 1):
            n = qsl[i + 1] - qsl[i] if i < meta.num_reqs else 0
            if n == 1:
                new_max = max(group_max, seq_lens[i])
                if not group or (len(group) + 1) * new_max * row_bytes <= self.decode_group_bytes:
                    group.append(i)
                    group_max = new_max
                    continue
            if group:
                self._decode(
                    q, out, k_cache, v_cache, meta, group, group_max, scale, sliding_window
                )
                group, group_max = [], 0
            if n == 1:
                group, group_max = [i], seq_lens[i]
            elif n > 1:
                self._prefill(q, out, k_cache, v_cache, meta, i, scale, sliding_window)
        return out

    @staticmethod
    def _decode(
        q: torch.Tensor,
        out: torch.Tensor,
        k_cache: KVCacheTensor,
        v_cache: KVCacheTensor,
        meta: AttentionMetadata,
        reqs: list[int],
        max_len: int,
        scale: float,
        sliding_window: int | None,
    ) -> None:
        """One SDPA call for the decode tokens of consecutive requests ``reqs``."""
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        first, last = reqs[0], reqs[-1] + 1
        b, group = len(reqs), q.shape[1] // num_kv_heads
        rows = slice(meta.query_start_loc_cpu[first], meta.query_start_loc_cpu[last])
        num_blocks = -(-max_len // block_size)
        s = num_blocks * block_size
        tables = meta.block_tables[first:last, :num_blocks].long()  # [b, nb]
        # [b, nb, bs, Hkv, D] -> [b, Hkv, S, D]
        kg = load_blocks(k_cache, tables).view(b, s, num_kv_heads, head_dim).transpose(1, 2).float()
        vg = load_blocks(v_cache, tables).view(b, s, num_kv_heads, head_dim).transpose(1, 2).float()
        qg = q[rows].float().view(b, num_kv_heads, group, head_dim)  # GQA group as query axis
        lens = meta.seq_lens[first:last].to(torch.int64)[:, None]  # [b, 1]
        mask: torch.Tensor | None = None
        if b > 1 or s != max_len or sliding_window is not None:
            k_pos = torch.arange(s, device=q.device)[None, :]  # [1, S]
            keep = k_pos < lens
            if sliding_window is not None:
                keep &= k_pos >= lens - sliding_window
            mask = keep[:, None, None, :]  # [b, 1, 1, S]
        o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale)
        out[rows] = o.reshape(b, -1, head_dim).to(out.dtype)

    @staticmethod
    def _prefill(
        q: torch.Tensor,
        out: torch.Tensor,
        k_cache: KVCacheTensor,
        v_cache: KVCacheTensor,
        meta: AttentionMetadata,
        i: int,
        scale: float,
        sliding_window: int | None,
    ) -> None:
        """One SDPA call for request i's chunk of n new tokens over its context [start, L)."""
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        rows = slice(meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1])
        n, seq_len = rows.stop - rows.start, meta.seq_lens_cpu[i]
        # Keys older than the first query's window are never read: start at their block.
        first_block = 0
        if sliding_window is not None:
            first_block = max(0, seq_len - n - sliding_window + 1) // block_size
        start = first_block * block_size
        num_blocks = -(-seq_len // block_size)
        tables = meta.block_tables[i, first_block:num_blocks].long()
        length = seq_len - start
        kg = load_blocks(k_cache, tables).view(1, -1, num_kv_heads, head_dim)[:, :length]
        vg = load_blocks(v_cache, tables).view(1, -1, num_kv_heads, head_dim)[:, :length]
        kg, vg = kg.transpose(1, 2).float(), vg.transpose(1, 2).float()
        qi = q[rows].float().unsqueeze(0).transpose(1, 2)  # [1, Hq, n, D]
        if length == n and sliding_window is None:
            o = F.scaled_dot_product_attention(
                qi, kg, vg, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            q_pos = torch.arange(seq_len - n, seq_len, device=q.device)[:, None]
            k_pos = torch.arange(start, seq_len, device=q.device)[None, :]
            mask = k_pos <= q_pos  # [n, length]
            if sliding_window is not None:
                mask &= k_pos > q_pos - sliding_window
            o = F.scaled_dot_product_attention(
                qi, kg, vg, attn_mask=mask, scale=scale, enable_gqa=True
            )
        out[rows] = o[0].transpose(0, 1).to(out.dtype)
