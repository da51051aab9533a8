"""The attention backend interface and the per-step metadata passed into ``model.forward``.

A step's batch is flat and unpadded: the new tokens of all requests are concatenated, request i
owning rows ``query_start_loc[i]:query_start_loc[i+1]``. Request i has ``seq_lens[i]`` tokens of
context *including* its new tokens, so its new tokens sit at positions
``seq_lens[i] - query_len_i ... seq_lens[i] - 1`` and each attends causally to every earlier
position (cached context in full, the new chunk causally).

Paged KV layout (per layer, K and V alike)::

    cache[num_blocks, block_size, num_kv_heads, head_dim]

    token position p of request i lives in
        block  = block_tables[i, p // block_size]
        offset = p % block_size
        slot   = block * block_size + offset        (slot_mapping holds this for new tokens)

Block tables are int32. Entries past a request's last block (padding) and before its sliding
window (blocks freed by the KV manager, kv/window.py) are never attended; the engine fills them
with blocks the request holds (its last, resp. first held block), so a backend that gathers them
(masked) reads that request's own finite K/V, never a block freed to another request.

Quantized KV: k_cache and/or v_cache may be a ``QuantizedKV(data, scale)`` (attention/quant.py)
instead of a tensor; backends with ``supports_quantized_kv`` quantize on write and dequantize on
load, and the model runner refuses a quantized cache with any other backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedllm.attention.quant import KVCacheTensor, write_slots

if TYPE_CHECKING:
    from pagedllm.lora.ops import LoRAMapping


@dataclass
class AttentionMetadata:
    """Everything an attention layer needs about the current step (STYLE 7: passed, not ambient)."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    query_start_loc: torch.Tensor  # [B+1] int32: prefix sums of query lengths
    seq_lens: torch.Tensor  # [B] int32: context length incl. new tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32
    max_query_len: int
    max_seq_len: int
    # Host copies for backends that dispatch per request (avoid device syncs).
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # the step's adapters (pagedllm/lora), read by the model's linears; None: base model only
    lora: LoRAMapping | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]


class AttentionBackend(ABC):
    """One small interface; backends register by name in ``attention.registry``.

    ``forward`` writes the new K/V into their slots, then attends. Shapes:
    q [T, Hq, D], k/v [T, Hkv, D], k_cache/v_cache [num_blocks, block_size, Hkv, D] -> [T, Hq, D].
    Hq is a multiple of Hkv (GQA / MQA). Accumulation is in fp32; the output has q's dtype.
    Either cache may be a ``QuantizedKV`` when ``supports_quantized_kv`` is set.
    """

    name: str = "base"
    supports_quantized_kv: bool = False
    # May be captured in a CUDA graph (runner/cuda_graph.py): in a decode-only step
    # (max_query_len == 1) it reads no host data (neither host list) and sizes its grid from
    # ``max_seq_len`` alone, which a graph fixes at max_model_len.
    supports_cuda_graphs: bool = False
    # Takes ``batch_invariant=True`` in its constructor: then a query row's output has the same
    # bits whatever else is in the step (neighbours, chunking, a prefix-cache hit).
    supports_batch_invariant: bool = False

    @abstractmethod
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
    ) -> torch.Tensor: ...


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: KVCacheTensor,
    v_cache: KVCacheTensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new K/V rows [T, Hkv, D] into their cache slots (shared by the CPU backends),
    quantizing into a ``QuantizedKV`` cache."""
    write_slots(k, k_cache, slot_mapping)
    write_slots(v, v_cache, slot_mapping)


def to_device(data: Sequence[int] | Sequence[float], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """A small tensor of host values (indices, per-request parameters) on ``device``; on CUDA
    through pinned memory with a non-blocking copy, so it does not wait for the stream."""
    t = torch.tensor(data, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)
