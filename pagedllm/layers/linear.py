"""Linear layers that know how checkpoint tensors map onto them."""

from __future__ import annotations

from torch import nn


class MergedLinear(nn.Linear):
    """Several projections of the same input fused along the output dim, e.g. q|k|v or gate|up.

    ``output_sizes`` are the row counts of the shards, in order; the loader copies checkpoint
    shard ``j`` into rows ``sum(output_sizes[:j]) : sum(output_sizes[:j + 1])`` of weight and bias.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = output_sizes

    def shard_rows(self, shard: int) -> slice:
        start = sum(self.output_sizes[:shard])
        return slice(start, start + self.output_sizes[shard])
