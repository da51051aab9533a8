"""The Triton attention backend: KV write, split-K paged decode, tiled paged prefill.

Decode rows (query_len == 1) go to ``decode_attention``, every other request's chunk to
``prefill_attention``; both read the paged cache in place (no gather) and accumulate in fp32.
In batch-invariant mode every query token goes to ``decode_attention`` as a row of its own, with
splits of a fixed length (``_token_rows``).
The per-step request split (which requests decode, which prefill) is computed once per step from
the host copies in the metadata and reused by every layer.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagedllm.attention.base import AttentionBackend, AttentionMetadata, to_device
from pagedllm.attention.quant import KVCacheTensor
from pagedllm.attention.triton import common
from pagedllm.attention.triton.decode import decode_attention
from pagedllm.attention.triton.kv_write import write_kv
from pagedllm.attention.triton.prefill import prefill_attention

_NEEDS_CUDA = (
    "the 'triton' attention backend needs a CUDA GPU (tensors on device='cuda'); on CPU use "
    "attention_backend='cpu', or set TRITON_INTERPRET=1 before triton is imported to run the "
    "kernels in Triton's interpreter on CPU tensors (slow; for tests)"
)


class _StepPlan(NamedTuple):
    """Which requests of a step decode and which prefill, as device index tensors."""

    decode_reqs: torch.Tensor  # [R] int32
    decode_max_seq_len: int
    prefill_reqs: torch.Tensor  # [P] int32
    prefill_max_query_len: int


class _TokenRows(NamedTuple):
    """Every query token of a step as a decode row of its own (batch-invariant mode)."""

    decode_reqs: torch.Tensor  # [T] int32: 0..T-1
    query_start_loc: torch.Tensor  # [T+1] int32: row i's query is token i
    seq_lens: torch.Tensor  # [T] int32: the token's position + 1
    block_tables: torch.Tensor  # [T, max_blocks] int32: its request's table
    max_seq_len: int


# Keys per decode split in batch-invariant mode: 4 tiles of 64 (head_dim <= 128)
INVARIANT_SPLIT_LEN = 256


class TritonBackend(AttentionBackend):
    """Paged attention in Triton kernels; see the package README for the kernel design.

    ``decode_target_programs`` and ``decode_min_split_len`` size the split-K grid: enough splits
    that (decode rows x KV heads x splits) reaches the target, no split under the minimum length.
    """

    name = "triton"
    supports_quantized_kv = True
    supports_cuda_graphs = True
    supports_batch_invariant = True
    decode_target_programs: int = 256
    decode_min_split_len: int = 256
    # Decode splits of this many keys whatever the batch, merged in split order (None: from
    # the batch, as above): batch-invariant decode.
    decode_split_len: int | None = None

    def __init__(self, batch_invariant: bool = False) -> None:
        """``batch_invariant``: every query token, prefill or decode, through the decode kernel
        with splits of ``INVARIANT_SPLIT_LEN`` keys: a token's bits then depend on its own
        position and keys alone, not on its chunk, its batch or where its prefix came from
        (the prefill kernel's tiles start where a chunk does)."""
        if not common.INTERPRET and not torch.cuda.is_available():
            raise ValueError(_NEEDS_CUDA)
        self.batch_invariant = batch_invariant
        if batch_invariant:
            self.decode_split_len = INVARIANT_SPLIT_LEN
        self._plan_meta: AttentionMetadata | None = None
        self._plan: _StepPlan | _TokenRows | None = None
        if torch.cuda.is_available() and not common.INTERPRET:
            sms = torch.cuda.get_device_properties(
                torch.cuda.current_device()
            ).multi_processor_count
            self.decode_target_programs = 2 * sms

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
        if q.device.type != "cuda" and not common.INTERPRET:
            raise ValueError(_NEEDS_CUDA)
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        if self.batch_invariant:
            rows = self._token_rows(meta, q.device)
            decode_attention(q, k_cache, v_cache, out, rows.decode_reqs, rows.query_start_loc,
                             rows.seq_lens, rows.block_tables, rows.max_seq_len, scale,
                             sliding_window, fixed_split_len=self.decode_split_len)
            return out
        plan = self._step_plan(meta, q.device)
        decode_attention(
            q,
            k_cache,
            v_cache,
            out,
            plan.decode_reqs,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            plan.decode_max_seq_len,
            scale,
            sliding_window,
            target_programs=self.decode_target_programs,
            min_split_len=self.decode_min_split_len,
            fixed_split_len=self.decode_split_len,
        )
        prefill_attention(
            q,
            k_cache,
            v_cache,
            out,
            plan.prefill_reqs,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            plan.prefill_max_query_len,
            scale,
            sliding_window,
        )
        return out

    def _token_rows(self, meta: AttentionMetadata, device: torch.device) -> _TokenRows:
        """The step's query tokens as decode rows, cached on the metadata's identity. A
        decode-only step's requests are those rows already (device data only: CUDA graphs)."""
        if meta is self._plan_meta and isinstance(self._plan, _TokenRows):
            return self._plan
        if meta.max_query_len == 1:
            n = meta.seq_lens.shape[0]
            rows = _TokenRows(torch.arange(n, dtype=torch.int32, device=device),
                              meta.query_start_loc, meta.seq_lens, meta.block_tables,
                              meta.max_seq_len)
        else:
            #   request i's tokens qsl[i] .. qsl[i+1]-1 end at key seq_lens[i] - 1:
            #   token t is at position seq_lens[i] - (qsl[i+1] - t)
            num_tokens = meta.num_tokens
            tok = torch.arange(num_tokens, dtype=torch.int32, device=device)
            qsl = meta.query_start_loc
            req = torch.searchsorted(qsl[1 : meta.num_reqs + 1], tok, right=True)
            seq_lens = (meta.seq_lens[req] - (qsl[1:][req] - 1 - tok)).to(torch.int32)
            rows = _TokenRows(tok, torch.arange(num_tokens + 1, dtype=torch.int32, device=device),
                              seq_lens, meta.block_tables[req], meta.max_seq_len)
        self._plan_meta, self._plan = meta, rows
        return rows

    def _step_plan(self, meta: AttentionMetadata, device: torch.device) -> _StepPlan:
        """The step's decode/prefill split, cached on the metadata object's identity (the model
        runner builds a fresh AttentionMetadata per step and never mutates it).

        A decode-only step (max_query_len == 1) is planned from device data and ``max_seq_len``
        alone (no host lists, no copies), so it can be captured in a CUDA graph."""
        if meta is self._plan_meta and isinstance(self._plan, _StepPlan):
            return self._plan
        if meta.max_query_len == 1:
            plan = _StepPlan(
                decode_reqs=torch.arange(meta.seq_lens.shape[0], dtype=torch.int32, device=device),
                decode_max_seq_len=meta.max_seq_len,
                prefill_reqs=torch.empty(0, dtype=torch.int32, device=device),
                prefill_max_query_len=0,
            )
        else:
            qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
            decode: list[int] = []
            prefill: list[int] = []
            for i in range(meta.num_reqs):
                n = qsl[i + 1] - qsl[i]
                if n == 1:
                    decode.append(i)
                elif n > 1:
                    prefill.append(i)
            plan = _StepPlan(
                decode_reqs=to_device(decode, torch.int32, device),
                decode_max_seq_len=max((seq_lens[i] for i in decode), default=0),
                prefill_reqs=to_device(prefill, torch.int32, device),
                prefill_max_query_len=max((qsl[i + 1] - qsl[i] for i in prefill), default=0),
            )
        self._plan_meta, self._plan = meta, plan
        return plan

