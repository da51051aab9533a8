"""Linear layers that know how checkpoint tensors map onto them (and, under tensor parallelism,
which slice of each checkpoint tensor this rank reads: ``source_index``), and that run on
a weight packed once on CPU (pagedllm's own float32 GEMM or oneDNN: ``pack_linears``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from pagedllm import kernels

if TYPE_CHECKING:
    from pagedllm.distributed.group import TPGroup


def onednn_dtypes() -> tuple[torch.dtype, ...]:
    """Weight dtypes oneDNN runs on this CPU: float32, and bfloat16 where the CPU has it."""
    if not torch.backends.mkldnn.is_available():
        return ()
    return (torch.float32, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)


# In float32, one row times a weight of at most this many elements runs faster on F.linear
# (MKL's gemv) than on oneDNN, whose call costs ~30 us more (it builds its primitive descriptor
# on every call): measured on 2 cores, 1-4x for the shapes of the two benchmark models up to
# 768 x 2048 (README "Performance"). Such layers keep their plain weight beside the packed one
# (small by definition; larger ones hold only the packed copy). In bfloat16 F.linear is no
# faster at one row (torch runs it on oneDNN too, unpacked), so bf16 layers are packed only.
GEMV_MAX_ELEMENTS = 2**21


class Linear(nn.Linear):
    """``nn.Linear`` that can swap its weight for a packed copy (``pack``).

    Two packings, both made once at load so that no call repacks the weight:

    - ``"gemm"`` (float32, and bfloat16 on CPUs with AVX512-BF16, where pagedllm's CPU kernels
      are built, the output width a multiple of 32): ``torch.ops.pagedllm.gemm_packed``
      (kernels/csrc/gemm.cpp, gemm_bf16.cpp), a register-tiled GEMM on 32-column panels with
      no per-call setup: in float32, at the rows a step runs (1-256), 1.0-1.6x oneDNN's time on
      the benchmark models' shapes, 3-20x at 1-8 rows (``pagedllm bench linear`` measures it).
    - ``"onednn"``: oneDNN's blocked layout for this CPU (float32, bfloat16 where the CPU has
      it): 1.3-5x the GFLOP/s of ``F.linear`` on 2 cores at the batch rows the engine runs; in
      float32 a single row on a small weight still goes to F.linear (``GEMV_MAX_ELEMENTS``).

    ``weight`` stays readable unless packing dropped it: an untied weight not needed for F.linear."""

    packed: torch.Tensor | None = None
    # "torch" (F.linear on weight), "onednn" or "gemm": what ``packed`` is; "triton": the
    # batch-invariant Triton GEMM on the plain weight (``use_triton_invariant``)
    kind: str = "torch"
    gemv: bool = False  # packed for oneDNN, and a single row still goes to F.linear on the plain weight

    def pack(self, keep_weight: bool = False, backend: str = "auto",
             weight_dtype: torch.dtype | None = None, any_width: bool = False) -> bool:
        """Pack the weight (``backend`` "auto": "gemm" where it runs, else "onednn"; or either
        by name); False (and nothing changes) where no packing runs it: not on CPU, no oneDNN,
        or a dtype it does not run here (``onednn_dtypes``, ``gemm_runs``). "auto" takes the
        GEMM for every dtype it runs, but bf16 on an AMX CPU (``onednn_first``): in the engine,
        side by side with oneDNN, 1.06-1.07x output tok/s in fp32 and 1.06x in bf16 (125M
        model, AVX512-BF16 without AMX).

        ``weight_dtype`` (bfloat16 / float16, for a float32 layer; ``w16_dtype``): the GEMM
        keeps the weight in that dtype and widens it to fp32 in registers (half the bytes a
        decode step reads; kernels/csrc/gemm_w16.cpp); where the GEMM does not take the layer
        it is packed as without it. ``any_width``: ``gemm_runs``'s."""
        w = self.weight
        if w.device.type != "cpu" or self.packed is not None:
            return False
        if weight_dtype is not None and backend in ("auto", "gemm") and gemm_runs(w):
            self.packed = torch.ops.pagedllm.pack_gemm_weight_w16(w.detach().to(weight_dtype))
            self.kind = "gemm"
        elif (backend == "gemm" or backend == "auto" and not onednn_first(w.dtype)) \
                and gemm_runs(w, any_width):
            self.packed, self.kind = torch.ops.pagedllm.pack_gemm_weight(w.detach()), "gemm"
        elif backend != "gemm" and w.dtype in onednn_dtypes():
            self.packed, self.kind = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None), "onednn"
            self.gemv = w.dtype == torch.float32 and w.numel() <= GEMV_MAX_ELEMENTS
        else:
            return False
        if not keep_weight and not self.gemv:
            # the packed copy is the weight now; keep shape and dtype visible
            self.weight = nn.Parameter(w.new_empty((0,) + w.shape[1:]), requires_grad=False)
        return True

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ W.T (+ bias); x [..., in] -> [..., out]."""
        if self.kind != "triton" and (self.packed is None
                                      or (self.gemv and x.numel() == x.shape[-1])):
            return F.linear(x, self.weight, bias)
        flat = x.reshape(-1, x.shape[-1])
        if self.kind == "triton":
            from pagedllm.layers import triton_invariant

            y = triton_invariant.matmul(flat, self.weight, bias)
        elif self.kind == "gemm":
            y = torch.ops.pagedllm.gemm_packed(flat.contiguous(), self.packed, self.out_features, bias)
        else:
            y = torch.ops.mkldnn._linear_pointwise(flat, self.packed, bias, "none", [], "")
        return y.view(*x.shape[:-1], y.shape[-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def op_args(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """(packed weight, plain weight, bias) as the fused decoder-layer ops take a linear
        (kernels/csrc/decoder_layer.cpp, which applies ``matmul``'s rule; a 3-D packed weight
        is a "gemm" one): the plain weight only where ``matmul`` may read it."""
        plain = self.weight if self.packed is None or self.gemv else None
        return self.packed, plain, self.bias


def gemm_dtypes() -> tuple[torch.dtype, ...]:
    """Weight dtypes pagedllm's GEMM runs on this CPU: float32 where the kernels are built with
    AVX-512 or AVX2 + FMA, bfloat16 where the CPU has AVX512-BF16 (``vdpbf16ps``); none without
    the kernels.
    Elsewhere those layers take oneDNN where ``onednn_dtypes`` has their dtype."""
    if not kernels.available():
        return ()
    ops = torch.ops.pagedllm
    runs = ((torch.float32, ops.gemm_vectorized()), (torch.bfloat16, ops.gemm_bf16_vectorized()))
    return tuple(dtype for dtype, ok in runs if ok)


def onednn_first(dtype: torch.dtype) -> bool:
    """Whether "auto" packs ``dtype`` for oneDNN even where pagedllm's GEMM runs it: bfloat16
    on a CPU with AMX-BF16, whose tile instructions oneDNN uses and the GEMM (vdpbf16ps) does
    not. 125M bf16 in the engine, side by side on such a CPU (`bench throughput --backends
    'pagedllm[linear_backend=gemm],pagedllm[linear_backend=onednn]'`): GEMM 0.65x."""
    return (dtype == torch.bfloat16 and "amx_bf16" in kernels.cpu_flags()
            and dtype in onednn_dtypes())


def gemm_runs(w: torch.Tensor, any_width: bool = False) -> bool:
    """Whether ``torch.ops.pagedllm.gemm_packed`` takes this weight: on CPU, an output width
    that is a multiple of 32 (the panel width, so the decoder-layer ops know it from the packed
    shape; ``any_width``: any, the last panel zero-padded, for ``matmul`` alone, which passes
    the width), and a dtype in ``gemm_dtypes``."""
    return (w.device.type == "cpu" and (any_width or w.shape[0] % 32 == 0)
            and w.dtype in gemm_dtypes())


def w16_dtype(dtype: str, device: str) -> str | None:
    """The 16-bit dtype a ``dtype`` model keeps its linear weights in while it computes in
    float32 (None: it computes in ``dtype``): bfloat16 or float16 on CPU where the kernels'
    ISA has no arithmetic for that dtype (bfloat16: AVX512-BF16, pagedllm's GEMM; float16:
    AVX512-FP16, oneDNN) but pagedllm's GEMM runs float32: an AVX2 CPU, or
    ``PAGEDLLM_ISA=avx2``. Decode reads every weight once a step, so the 16-bit weights halve
    its bytes; 16-bit activations there would run on torch's and oneDNN's emulated paths (~4x
    slower than float32 on an AVX2 CPU: README)."""
    if device != "cpu" or dtype not in ("bfloat16", "float16") or not kernels.available():
        return None
    if torch.float32 not in gemm_dtypes():
        return None
    if dtype == "bfloat16" and torch.bfloat16 in gemm_dtypes():
        return None
    if dtype == "float16" and kernels.isa() == "avx512" and "avx512_fp16" in kernels.cpu_flags():
        return None
    return dtype


def pack_linears(model: nn.Module, backend: str = "auto",
                 weight_dtype: torch.dtype | None = None, any_width: bool = False) -> int:
    """Pack every ``Linear`` of ``model`` (see ``Linear.pack``); returns how many were.

    A weight shared with another module (lm_head tied to the input embedding) is packed as a
    copy and kept, since the embedding lookup still reads the plain tensor."""
    owners: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return sum(m.pack(keep_weight=owners[id(m.weight)] > 1, backend=backend,
                      weight_dtype=weight_dtype, any_width=any_width)
               for m in model.modules() if isinstance(m, Linear))


def pack_batch_invariant(model: nn.Module, weight_dtype: torch.dtype | None = None) -> int:
    """Batch-invariant mode: every ``Linear`` of ``model`` on pagedllm's GEMM, whatever its
    width. Each of its outputs is one fp32 sum in k order, by the same instructions at every
    row count (gemm.h: rows only pick the register tile's height), so a row's bits do not
    depend on the other rows; oneDNN's kernel and blocking, and F.linear's 1-row GEMV, do.
    A decoder layer with a width that is not a multiple of 32 runs its modules (the two
    decoder-layer ops read the width from the packed shape); returns how many do. Raises
    ValueError naming the flag where the GEMM does not run. ``weight_dtype``: ``pack``'s."""
    pack_linears(model, "gemm", weight_dtype, any_width=True)
    left = {str(m.weight.dtype) for m in model.modules() if isinstance(m, Linear) and m.kind != "gemm"}
    if left:
        raise ValueError(
            f"--batch-invariant runs every linear layer on pagedllm's CPU GEMM, which does not "
            f"run {', '.join(sorted(left))} here (it runs: "
            f"{', '.join(map(str, gemm_dtypes())) or 'nothing: the CPU kernels are unavailable'}); "
            f"use --dtype float32 (or bfloat16 on a CPU with AVX512-BF16), or drop --batch-invariant")
    odd = [layer for layer in model.modules() if isinstance(getattr(type(layer), "fused_layer", None), bool)
           and any(isinstance(m, Linear) and m.out_features % 32 for m in layer.modules())]
    for layer in odd:
        kernels.set_fused_ops(layer, False, "fused_layer")
    return len(odd)


def use_triton_invariant(model: nn.Module) -> int:
    """Batch-invariant mode on the Triton kernel family (layers/triton_invariant.py): every
    ``Linear`` on the Triton GEMM with one tile for every batch, every ``RMSNorm`` on the
    row-per-program Triton kernel, and the fused CPU ops off (the decoder-layer op would skip
    both; the GPU never runs them). Returns how many linears; raises ValueError naming the
    flag for a weight dtype the kernels do not take."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    bad = {str(m.weight.dtype) for m in linears
           if m.weight.dtype not in (torch.float32, torch.float16, torch.bfloat16)}
    if bad or any(m.packed is not None for m in linears):
        raise ValueError(f"--batch-invariant's Triton GEMM takes float32 / float16 / bfloat16 "
                         f"weights, not {', '.join(sorted(bad)) or 'packed ones'}; use --dtype "
                         f"bfloat16 or float32, or drop --batch-invariant")
    kernels.set_fused_ops(model, False)
    kernels.set_fused_ops(model, False, "fused_layer")
    kernels.set_fused_ops(model, True, "invariant")
    for m in linears:
        m.kind = "triton"
    return len(linears)


class MergedLinear(Linear):
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


class RowParallelLinear(Linear):
    """Input features split over the tensor-parallel group: each rank multiplies its slice of the
    input by its columns of the weight; an all-reduce sums the partial outputs; the (replicated)
    bias is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__(in_features, out_features, bias=bias)  # in_features: this rank's share
        self.tp = tp
        self.source_cols = slice(tp.rank * in_features, (tp.rank + 1) * in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self.matmul(x, None))
        return y if self.bias is None else y + self.bias

    def source_index(self, shard: int | None, leaf: str) -> tuple[slice, ...] | None:
        return (slice(None), self.source_cols) if leaf == "weight" else None


def row_parallel_linear(in_features: int, out_features: int, bias: bool,
                        tp: TPGroup | None) -> Linear:
    """A plain ``Linear`` without tensor parallelism (the single-process path is unchanged)."""
    if tp is None:
        return Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, tp)
