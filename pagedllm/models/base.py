"""The interface every model class offers the model runner."""

from __future__ import annotations

from abc import abstractmethod

import torch
from torch import nn

from pagedllm.attention.base import AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache), each [blocks, bs, Hkv, D]


class CausalLM(nn.Module):
    """``forward`` runs a flat step batch and returns final hidden states [T, hidden];
    ``compute_logits`` turns the rows the runner picks into fp32 logits [N, vocab] (or, with
    ``fp32=False``, logits in the LM head's own dtype, for a greedy argmax that needs no
    converted copy)."""

    # checkpoint projection name -> (fused module name, shard index); read by the loader
    FUSED_WEIGHTS: dict[str, tuple[str, int]] = {}

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[KVCache],  # one per layer
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor: ...

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor: ...

    @abstractmethod
    def tie_weights(self) -> None:
        """Share lm_head's weight with the input embedding."""

    @property
    @abstractmethod
    def max_positions(self) -> int:
        """Largest number of positions the model supports (its rotary table's length)."""
