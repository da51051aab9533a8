"""The batched mixed-adapter LoRA delta of one linear layer: ``y += B[slot(t)] @ A[slot(t)] @ x_t``
for every token t of the step, the base model's tokens (slot ``max_loras``, all zeros) untouched.

Per linear the adapter slots are stacked (lora/manager.py)::

    A  [S+1, n*R, in]        n = shards of a fused linear (qkv: 3, gate_up: 2, else 1), R = max rank
    B  n x [S+1, out_j, R]   scaling folded in; slot S stays zero (the base model)

Four ways to run it, same arithmetic (``LoRAMapping.method``):

- ``"dense"``: every adapter slot at once, masked: ``h = x @ A_flat.T`` [T, S*n*R], zero each
  token's parts of other slots (a one-hot mask made once per step; the base's tokens: all), then
  per shard one GEMM with ``B_flat_j`` [S*R, out_j]: 2 + 2n ops per linear whatever the number
  of adapters, reading every slot's weights once. The fastest on small (decode) steps, where
  per-op overhead and weight reads, not multiply-adds, are the cost (measured: README), and on
  large ones whose adapters fill most slots (``DENSE_MAX_TOKENS``). On CPU
  both GEMMs run on pagedllm's packed GEMM (``LoRAStack.pack``, after a slot load), several
  times faster than torch's matmuls at 8 rows (docs/features/lora.md).
- ``"loop"`` (SGMV-like): for each adapter present in the step (<= max_loras), the rows of its
  tokens: ``h = x[rows] @ A[s].T``, ``y[rows, cols_j] += h[:, jR:(j+1)R] @ B_j[s].T``. Two small
  GEMMs per adapter and shard; no gathered weights. Used for large steps that use few of the
  slots.
- ``"triton"`` (CUDA): the same per-token shapes as "gather" in two Triton kernels, shrink and
  expand, with no gathered copies of the weights (lora/triton_ops.py).
- ``"gather"`` (BGMV-like): gather every token's A and B by index and run batched mat-vecs
  (``torch.bmm``): one op per shard whatever the number of adapters; the gathered weights are
  [T, n*R, in] + [T, out, R]. Never picked by default (slower than "dense" on decode steps on
  CPU: README); kept as a tested reference and a ``method`` to measure.

A linear that no adapter of the step targets is skipped by every way (``LoRAMapping.targeted``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

# steps with at most this many tokens use "dense"; larger ones too where the step's adapters
# fill at least half of the slots and the slots run on pagedllm's packed GEMM (measured with
# every slot used: dense faster than "loop" on 4,096-token prefills, 0.55x vs 0.41x of base on
# the shipped model, 0.77x vs 0.70x on a 100M one); else "loop", which multiplies only the
# slots in use. The cut at 64 tokens and the half are guesses, not measured
DENSE_MAX_TOKENS = 64


@dataclass
class LoRAStack:
    """One linear layer's adapter slots (see the module docstring)."""

    a: torch.Tensor  # [S+1, n*R, in]
    b: list[torch.Tensor]  # n x [S+1, out_j, R]
    offsets: list[int]  # first output column of each shard
    rank: int  # R
    b_flat: list[torch.Tensor]  # n x [S*R, out_j]: row (s, k) = B_j[s, :, k] (slots < S)
    # a row-parallel linear under tensor parallelism: each rank holds its columns of A, so
    # ``h = x @ A.T`` is a partial sum, all-reduced (T x n*R values) before B multiplies it
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    # "dense" on pagedllm's GEMM (kernels/csrc/gemm.cpp): A_flat [S*nR, in] and each B_flat_j.T
    # [out_j, S*R] packed as weights, remade after a slot load (None: torch's matmuls)
    packed_a: torch.Tensor | None = None
    packed_b: list[torch.Tensor] | None = None

    @functools.cached_property
    def op_dims(self) -> list[int]:
        """[rank, width_j ...]: the shard sizes the decoder-layer ops take (``LoRAMapping.
        op_args``); the shards lie in order from column 0."""
        widths = [bf.shape[1] for bf in self.b_flat]
        assert self.offsets == [sum(widths[:j]) for j in range(len(widths))], "shards in order"
        return [self.rank, *widths]

    def pack(self, num_slots: int) -> None:
        """Pack the slots' A and B for the dense method's GEMMs (after a slot load)."""
        pack = torch.ops.pagedllm.pack_gemm_weight
        self.packed_a = pack(self.a[:num_slots].flatten(0, 1))
        self.packed_b = [pack(bf.t().contiguous()) for bf in self.b_flat]


@dataclass
class LoRAMapping:
    """A step's adapters, built by the runner from the scheduled requests (lora/manager.py).

    ``token_slots`` [T] int64: each token's slot (S = the base model); ``groups`` ("loop"): per
    slot present in the step, the rows of its tokens and the linears its adapter targets."""

    token_slots: torch.Tensor
    groups: list[tuple[int, torch.Tensor, frozenset[nn.Module]]]
    stacks: dict[nn.Module, LoRAStack]
    method: str  # "dense" | "loop" | "gather" | "triton"
    onehot: torch.Tensor | None = None  # [T, S, 1] in the model's dtype ("dense")
    # the linears some adapter of the step targets (None: every one with a stack); the others
    # add nothing and are skipped (under tensor parallelism: no all-reduce for them either)
    targeted: frozenset[nn.Module] | None = None
    host_slots: torch.Tensor | None = None  # token_slots on the host (a decode graph's input)

    @functools.cached_property
    def fusable(self) -> bool:
        """Whether the decoder-layer ops can add the deltas themselves (kernels/csrc/
        decoder_layer.cpp ``add_lora_``, the "dense" method's ops in its order): "dense" on
        packed slots, one rank."""
        return self.method == "dense" and self.onehot is not None and all(
            st.packed_a is not None and st.packed_b is not None and st.reduce is None
            for st in self.stacks.values())

    def op_args(self, linear: nn.Module) -> tuple[list[torch.Tensor], list[int]]:
        """``linear``'s LoRA arguments for the decoder-layer ops (``fusable`` steps): [packed
        A_flat, packed B_flat_j^T ...] and [rank, width_j ...]; empty where ``apply`` adds
        nothing."""
        stack = self.stacks.get(linear)
        if stack is None or (self.targeted is not None and linear not in self.targeted):
            return [], []
        assert stack.packed_a is not None and stack.packed_b is not None
        return [stack.packed_a, *stack.packed_b], stack.op_dims

    def apply(self, linear: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (``linear``'s output [T, out] for input ``x`` [T, in]) plus the adapters'
        deltas, in place."""
        stack = self.stacks.get(linear)
        if stack is None or (self.targeted is not None and linear not in self.targeted):
            return y
        if self.method == "dense":
            assert self.onehot is not None
            s, r = self.onehot.shape[1], stack.rank
            a = stack.a[:s].flatten(0, 1)  # [S*nR, in]: the zero base slot left out
            pa, pb = stack.packed_a, stack.packed_b
            h = x @ a.t() if pa is None else _gemm(x, pa, a.shape[0])
            h = _sum(stack, h).view(x.shape[0], s, -1) * self.onehot  # [T, S, nR]
            for j, (bf, off) in enumerate(zip(stack.b_flat, stack.offsets)):
                hj = h[:, :, j * r:(j + 1) * r].reshape(x.shape[0], s * r)  # [T, S*R]
                out = y[:, off:off + bf.shape[1]]
                if pb is None:
                    out.addmm_(hj, bf)
                else:
                    out.add_(_gemm(hj, pb[j], bf.shape[1]))
            return y
        if self.method == "gather":
            return _gather(stack, self.token_slots, x, y)
        if self.method == "triton":  # CUDA (lora/triton_ops.py): shrink, then one expand per shard
            from pagedllm.lora import triton_ops

            h = _sum(stack, triton_ops.shrink(x, stack.a, self.token_slots))
            for j, (b, off) in enumerate(zip(stack.b, stack.offsets)):
                triton_ops.expand(h, b, self.token_slots, y, j * stack.rank, off)
            return y
        r = stack.rank
        for slot, rows, targets in self.groups:
            if linear not in targets:
                continue
            h = _sum(stack, x.index_select(0, rows) @ stack.a[slot].t())  # [t, n*R]
            for j, (b, off) in enumerate(zip(stack.b, stack.offsets)):
                delta = h[:, j * r:(j + 1) * r] @ b[slot].t()  # [t, out_j]
                y[:, off:off + b.shape[1]].index_add_(0, rows, delta)
        return y


def _gather(stack: LoRAStack, slots: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    r = stack.rank
    h = _sum(stack, torch.bmm(stack.a.index_select(0, slots), x.unsqueeze(-1)))  # [T, n*R, 1]
    for j, (b, off) in enumerate(zip(stack.b, stack.offsets)):
        delta = torch.bmm(b.index_select(0, slots), h[:, j * r:(j + 1) * r])  # [T, out_j, 1]
        y[:, off:off + b.shape[1]] += delta.squeeze(-1)
    return y


def _sum(stack: LoRAStack, h: torch.Tensor) -> torch.Tensor:
    """``h = x @ A.T`` over every rank's columns of A (a row-parallel linear under tensor
    parallelism; every rank reduces in the same order: the same groups, the same linears)."""
    return h if stack.reduce is None else stack.reduce(h)


def _gemm(x: torch.Tensor, packed: torch.Tensor, width: int) -> torch.Tensor:
    return torch.ops.pagedllm.gemm_packed(x.contiguous(), packed, width, None)
