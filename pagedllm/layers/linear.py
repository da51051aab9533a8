"""Linear layers that know how checkpoint tensors map onto them (and, under tensor parallelism,
which slice of each checkpoint tensor this rank reads: ``source_index``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

if TYPE_CHECKING:
    from pagedllm.distributed.group import TPGroup


class MergedLinear(nn.Linear):
    """Several projections of the same input fused along the output dim, e.g. q|k|v or gate|up.

    ``output_sizes`` are the row counts of the shards, in order; the loader copies checkpoint
    shard ``j`` into rows ``sum(output_sizes[:j]) : sum(output_sizes[:j + 1])`` of weight and bias.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool,
                 source_rows: list[slice] | None = None) -> None:
        """``source_rows[j]``: the rows of checkpoint shard ``j`` this rank holds (column-parallel
        under tensor parallelism); None: every row."""
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = output_sizes
        self.source_rows = source_rows

    def shard_rows(self, shard: int) -> slice:
        start = sum(self.output_sizes[:shard])
        return slice(start, start + self.output_sizes[shard])

    def source_index(self, shard: int | None, leaf: str) -> tuple[slice, ...] | None:
        """Index into checkpoint shard ``shard``'s weight or bias; None: the whole tensor."""
        if self.source_rows is None or shard is None:
            return None
        return (self.source_rows[shard],)


class RowParallelLinear(nn.Linear):
    """Input features split over the tensor-parallel group: each rank multiplies its slice of the
    input by its columns of the weight; an all-reduce sums the partial outputs; the (replicated)
    bias is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__(in_features, out_features, bias=bias)  # in_features: this rank's share
        self.tp = tp
        self.source_cols = slice(tp.rank * in_features, (tp.rank + 1) * in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias

    def source_index(self, shard: int | None, leaf: str) -> tuple[slice, ...] | None:
        return (slice(None), self.source_cols) if leaf == "weight" else None


def row_parallel_linear(in_features: int, out_features: int, bias: bool,
                        tp: TPGroup | None) -> nn.Linear:
    """A plain ``nn.Linear`` without tensor parallelism (the single-process path is unchanged)."""
    if tp is None:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, tp)
