"""This process's place in the tensor-parallel group: rank, size, the all-reduce, and which heads
and rows of the checkpoint it owns.

Megatron-style sharding of one decoder layer over N ranks (rank r shown)::

    qkv_proj      column-parallel   q heads  [r*Hq/N, (r+1)*Hq/N)
                                    kv heads [r*Hkv/N, ...)  or, when N > Hkv, the one kv head
                                             r*Hkv//N, replicated on N/Hkv ranks
    o_proj        row-parallel      input columns of this rank's q heads, then all-reduce
    gate_up_proj  column-parallel   rows [r*I/N, (r+1)*I/N) of gate and of up
    down_proj     row-parallel      input columns [r*I/N, (r+1)*I/N), then all-reduce
    embed_tokens, norms, lm_head    replicated (every rank holds the full vocab; rank 0 samples)

Row-parallel biases are added once, after the all-reduce. Two all-reduces of [T, hidden] per layer
are the whole communication of a forward; ``CommStats`` counts them.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.config import ModelConfig


@dataclass
class CommStats:
    """Communication counters of one rank (bytes this rank contributes; seconds it waited)."""

    allreduce_calls: int = 0
    allreduce_bytes: int = 0
    allreduce_seconds: float = 0.0
    control_messages: int = 0
    control_bytes: int = 0  # step metadata / block moves sent to each worker (pickled size)
    control_seconds: float = 0.0
    steps: int = 0

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]


class TPGroup:
    """Rank ``rank`` of ``size``; ``pg`` is a torch.distributed ProcessGroupGloo (or NCCL), attached
    once every rank has joined (the model is built before, so sharding needs only rank/size)."""

    def __init__(self, rank: int, size: int, pg: Any = None) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside a tensor-parallel group of size {size}")
        self.rank, self.size, self.pg = rank, size, pg
        self.stats = CommStats()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group in place (every rank gets the same bits)."""
        if self.pg is None:
            raise RuntimeError("tensor-parallel group used before its process group was attached")
        t0 = time.perf_counter()
        self.pg.allreduce([x]).wait()
        st = self.stats
        st.allreduce_seconds += time.perf_counter() - t0
        st.allreduce_calls += 1
        st.allreduce_bytes += x.numel() * x.element_size()
        return x

    def split(self, n: int, what: str) -> tuple[int, int]:
        """(start, count) of this rank's equal share of ``n`` items."""
        if n % self.size:
            raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size={self.size}")
        per = n // self.size
        return self.rank * per, per


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank owns (q heads contiguous; kv heads those the q heads use)."""

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int


def shard_heads(num_heads: int, num_kv_heads: int, tp: TPGroup | None) -> HeadShard:
    if tp is None:
        return HeadShard(0, num_heads, 0, num_kv_heads)
    q_start, q_n = tp.split(num_heads, "num_attention_heads")
    if num_kv_heads >= tp.size:
        kv_start, kv_n = tp.split(num_kv_heads, "num_key_value_heads")
    elif tp.size % num_kv_heads == 0:  # fewer kv heads than ranks: each rank keeps a copy of one
        kv_start, kv_n = tp.rank * num_kv_heads // tp.size, 1
    else:
        raise ValueError(
            f"num_key_value_heads={num_kv_heads} and tensor_parallel_size={tp.size}: the size must "
            f"divide the kv heads or be a multiple of them"
        )
    return HeadShard(q_start, q_n, kv_start, kv_n)


def check_tp_size(num_heads: int, num_kv_heads: int, intermediate_size: int, size: int) -> None:
    """Raise a ValueError saying what to change when a model cannot be split ``size`` ways."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size={size} must be >= 1")
    try:
        for r in range(size):
            tp = TPGroup(r, size)
            shard_heads(num_heads, num_kv_heads, tp)
            tp.split(intermediate_size, "intermediate_size")
    except ValueError as e:
        ok = [s for s in range(1, num_heads + 1) if _splits(num_heads, num_kv_heads, intermediate_size, s)]
        raise ValueError(f"{e}; this model splits into tensor_parallel_size in {ok}") from None


def _splits(num_heads: int, num_kv_heads: int, intermediate_size: int, size: int) -> bool:
    kv_ok = num_kv_heads % size == 0 or size % num_kv_heads == 0
    return num_heads % size == 0 and intermediate_size % size == 0 and kv_ok


def rows(start: int, count: int, unit: int = 1) -> slice:
    return slice(start * unit, (start + count) * unit)


def local_kv_model(model: ModelConfig, tp: TPGroup | None) -> ModelConfig:
    """``model`` as this rank's KV cache sees it: only the kv heads the rank owns."""
    if tp is None:
        return model
    n = shard_heads(model.num_attention_heads, model.num_key_value_heads, tp).num_kv_heads
    return dataclasses.replace(model, num_key_value_heads=n)
