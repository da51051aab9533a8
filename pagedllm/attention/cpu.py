"""The fast CPU attention backend.

Every request of the step, decode tokens and prefill chunks alike, goes to the C++ kernel
``torch.ops.pagedllm.paged_attention`` (pagedllm/kernels/csrc/paged_attention.cpp) when it is
available: one call per layer, reading K/V rows in place through the block table (no gather
copy, no cast: bf16 / fp16 rows are widened in registers), online softmax in fp32, causal per
query token, parallel over (request, 16 query tokens, kv heads). Measured against the SDPA path
below (1 thread, 12 q / 4 kv heads, head_dim 64, one fresh prompt of n tokens, busy machine):
n = 64: 0.11 vs 0.20 ms (fp32), 0.09 vs 0.21 (bf16); n = 512: 11.0 vs 19.4 ms (fp32), 7.0 vs
19.2 (bf16). Without the kernel (no compiler, ``PAGEDLLM_CPU_KERNELS=0``, or
``CpuBackend(use_kernel=False)``), every request takes the SDPA path.

SDPA path: decode tokens (query_len == 1) of consecutive requests are batched into one SDPA call over their
gathered blocks, in groups whose gathered K stays under ``decode_group_bytes`` (see below); each
prefill chunk is one SDPA call over its request's gathered context. GQA never materialises
repeated K/V: decode folds the query group into the query-length axis, prefill uses
``enable_gqa``. Everything is computed in fp32 and cast back to q's dtype.

Why groups, not one batched call: the gathered K/V of a group is written, then read back by
SDPA; while it fits in L2 the read back is cheap. Measured (1 thread, 16 requests, 2 kv heads,
head_dim 32, busy 2-core machine, noisy): 512 tokens x 16 requests in one call of 2 MiB took
2.2 ms, in groups of 512 KiB 0.9 ms; at 2048 tokens, groups of 256 KiB-2 MiB were within noise
of each other (3.4-3.8 ms). The gather itself is an ``index_select`` of whole blocks
(``gather_blocks``), 2-2.5x faster than ``cache[block_table]``.

A decode group whose requests all have ``max_len`` tokens attends without a mask (the gathered
view is cut at ``max_len``); only ragged groups and sliding windows build one.

Invariant required of the caller: every slot a request's table entries name holds finite values
(allocate the KV cache with ``torch.zeros``, not ``torch.empty``). Batched decode reads the unused
tail of each request's last block, its padding entries and, with a sliding window, the entries
before its own window (the group starts at its earliest window); they are masked out, but NaN/Inf
there would still leak through ``0 * NaN``. The engine's tables name only blocks the request
holds there (attention/base.py), so what a freed block holds never matters.

Quantized KV (``QuantizedKV`` caches) is dequantized to fp32 right after the block gather
(``gather_blocks``), so the SDPA calls are the same as for an fp32 cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm import kernels
from pagedllm.attention.base import AttentionBackend, AttentionMetadata, write_kv
from pagedllm.attention.quant import KVCacheTensor, QuantizedKV, dequantize, raw


def gather_blocks(
    cache: KVCacheTensor, index: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``cache[index]`` as fp32 [len(index), block_size, Hkv, D] (quantized caches dequantized).

    ``index_select`` on the cache viewed as [num_blocks, block_size * Hkv * D] copies whole
    blocks as rows; advanced indexing ``cache[index]`` took 2-2.5x as long (1 thread). ``out``
    (fp32, at least that many elements) receives the blocks of an fp32 cache instead of a fresh
    tensor; other caches ignore it.
    """
    nb, bs, h, d = cache.shape
    if isinstance(cache, QuantizedKV):
        data = raw(cache.data).view(nb, -1).index_select(0, index).view(cache.data.dtype)
        scale = cache.scale.view(nb, -1).index_select(0, index)
        return dequantize(data.view(-1, bs, h, d), scale.view(-1, bs, h))
    flat = cache.view(nb, -1)  # [num_blocks, bs * Hkv * D]
    if out is not None and cache.dtype == torch.float32:
        rows = out[: index.numel() * flat.shape[1]].view(-1, flat.shape[1])
        return torch.index_select(flat, 0, index, out=rows).view(-1, bs, h, d)
    return flat.index_select(0, index).view(-1, bs, h, d).float()


def paged_attention(
    q: torch.Tensor,
    k_cache: KVCacheTensor,
    v_cache: KVCacheTensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
    max_query_len: int,
    fixed_tiles: bool = False,
) -> None:
    """``out`` rows of every request of the step with at most ``max_query_len`` query tokens
    (1: decode only), through the C++ kernel; other rows are left as they are. ``fixed_tiles``:
    a sliding window's tiles on the grid of multiples of 64 positions, so that a row's bits do
    not depend on the chunk it is computed in (batch-invariant mode). q/out
    [T, Hq, D] (fp32/fp16/bf16), caches [num_blocks, block_size, Hkv, D] plain
    (fp32/fp16/bf16) or ``QuantizedKV`` (int8/fp8); the kernel checks shapes, dtypes and
    strides."""
    def parts(c: KVCacheTensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return (c.data, c.scale) if isinstance(c, QuantizedKV) else (c, None)

    torch.ops.pagedllm.paged_attention(
        q, *parts(k_cache), *parts(v_cache), meta.block_tables, meta.seq_lens,
        meta.query_start_loc, out, scale, sliding_window, max_query_len, fixed_tiles)


class CpuBackend(AttentionBackend):
    name = "cpu"
    supports_quantized_kv = True
    supports_batch_invariant = True
    decode_group_bytes: int = 1 << 19  # of gathered K
    workspace_bytes: int = 1 << 24  # largest K (and V) decode gather kept in the workspace

    def __init__(self, use_kernel: bool | None = None, batch_invariant: bool = False) -> None:
        """``use_kernel``: decode through the C++ kernel (None: when it builds or is cached).
        ``batch_invariant``: every row through the kernel, on its fixed tile grid (a row's
        bits depend on its request alone; the SDPA path's sums depend on the decode group)."""
        self.use_kernel = kernels.available() if use_kernel is None else use_kernel
        if (self.use_kernel or batch_invariant) and not kernels.available():
            raise RuntimeError(f"CPU kernels unavailable: {kernels.unavailable_reason()}"
                               + ("; --batch-invariant needs them" if batch_invariant else ""))
        if batch_invariant and not self.use_kernel:
            raise ValueError("batch_invariant attention runs on the C++ kernel; use_kernel=False "
                             "takes the SDPA path, whose sums depend on the batch")
        self.batch_invariant = batch_invariant
        # fp32 [2, n] K and V gather buffers reused by every decode call (of every layer): a
        # fresh allocation per call of a few hundred KiB and up costs page faults, measured
        # 1.9x the time of the whole decode call at 16 x 128 tokens in blocks of 256.
        self._workspace = torch.empty(2, 0)
        self._plan_meta: AttentionMetadata | None = None
        self._plan: list[tuple[bool, list[int], int]] = []

    def _decode_buffers(self, numel: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """K and V gather buffers of ``numel`` fp32 elements, or None past ``workspace_bytes``."""
        if numel * 4 > self.workspace_bytes:
            return None, None
        if self._workspace.shape[1] < numel:
            self._workspace = torch.empty(2, numel)
        return self._workspace[0], self._workspace[1]

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
        return self.attend(q, k_cache, v_cache, meta, scale, sliding_window)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: KVCacheTensor,
        v_cache: KVCacheTensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """``forward`` once the step's new K/V are in their slots (the fused decoder layer,
        models/llama.py, writes them itself): q [T, Hq, D] -> [T, Hq, D]."""
        out = torch.empty_like(q)
        if self.use_kernel:  # every request of the step, decode and prefill, in one call
            paged_attention(q, k_cache, v_cache, meta, scale, sliding_window, out, q.shape[0],
                            self.batch_invariant)
            return out
        for decode, reqs, max_len in self._step_plan(meta, k_cache.shape[2] * k_cache.shape[3] * 4):
            if decode:
                self._decode(q, out, k_cache, v_cache, meta, reqs, max_len, scale, sliding_window)
            else:
                self._prefill(q, out, k_cache, v_cache, meta, reqs[0], scale, sliding_window)
        return out

    def _step_plan(self, meta: AttentionMetadata, row_bytes: int) -> list[tuple[bool, list[int], int]]:
        """The step's calls in request order: (True, consecutive decode requests, their longest
        length) grouped under ``decode_group_bytes``, or (False, [one prefill request], 0).
        Computed once per step (cached on the metadata object's identity: the model runner
        builds a fresh AttentionMetadata per step) and reused by every layer."""
        if meta is self._plan_meta:
            return self._plan
        qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        plan: list[tuple[bool, list[int], int]] = []
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
                plan.append((True, group, group_max))
                group, group_max = [], 0
            if n == 1:
                group, group_max = [i], seq_lens[i]
            elif n > 1:
                plan.append((False, [i], 0))
        self._plan_meta, self._plan = meta, plan
        return plan

    def _decode(
        self,
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
        lens_cpu = meta.seq_lens_cpu[first:last]
        # Blocks wholly before every request's window are never read.
        first_block = 0
        if sliding_window is not None:
            first_block = max(0, min(lens_cpu) - sliding_window) // block_size
        start = first_block * block_size
        num_blocks = -(-max_len // block_size)
        s = (num_blocks - first_block) * block_size
        index = meta.block_tables[first:last, first_block:num_blocks].reshape(-1)  # [b * nb]
        # [b * nb, bs, Hkv, D] -> [b, Hkv, S, D] (strided views, SDPA reads them as they are),
        # cut at the longest request: no mask at all when every length is max_len.
        s_used = max_len - start
        kbuf, vbuf = self._decode_buffers(b * s * num_kv_heads * head_dim)
        kg = gather_blocks(k_cache, index, kbuf).view(b, s, num_kv_heads, head_dim)[:, :s_used]
        vg = gather_blocks(v_cache, index, vbuf).view(b, s, num_kv_heads, head_dim)[:, :s_used]
        kg, vg = kg.transpose(1, 2), vg.transpose(1, 2)
        qg = q[rows].float().view(b, num_kv_heads, group, head_dim)  # GQA group as query axis
        mask: torch.Tensor | None = None
        if any(n != max_len for n in lens_cpu) or sliding_window is not None:
            lens = meta.seq_lens[first:last].to(torch.int64)[:, None]  # [b, 1]
            k_pos = torch.arange(start, max_len, device=q.device)[None, :]  # [1, S]
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
        index = meta.block_tables[i, first_block:num_blocks]
        length = seq_len - start
        kg = gather_blocks(k_cache, index).view(1, -1, num_kv_heads, head_dim)[:, :length]
        vg = gather_blocks(v_cache, index).view(1, -1, num_kv_heads, head_dim)[:, :length]
        kg, vg = kg.transpose(1, 2), vg.transpose(1, 2)
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
