"""How big the KV pool may be on a GPU: ``gpu_memory_utilization`` minus what everything else uses.

::

    memory free when the engine starts ───────────────────────────────────────────────┐
    │◀──────────── gpu_memory_utilization x free at start ──────────────▶│  left alone  │
    │ weights │ activation peak │ non-torch │ CUDA-graph pool │ KV pool  │  (headroom)  │
    │         │ (profiled step) │ (cuBLAS   │ (decode graphs) │ = the    │              │
    │         │                 │ workspace)│                 │   rest   │              │

The engine loads the weights, then runs one profiling step of the largest batch the scheduler
can form (``max_num_batched_tokens`` tokens over ``max_num_seqs`` requests, logits and the most
expensive sampling options included) against a throw-away KV cache, and reads the CUDA caching
allocator's peak. ``non-torch`` is memory the process holds outside the caching allocator (the
CUDA context, cuBLAS workspaces), seen as the growth of ``total - free`` that ``memory_reserved``
does not explain. Capturing decode CUDA graphs needs a private pool for their activations; it is
estimated by a second profiling step at the largest captured decode batch.

``kv_budget`` is the pure arithmetic (unit-tested on CPU with made-up numbers);
``MemoryProfiler`` reads the numbers from ``torch.cuda``; the profiling step itself is the
runner's own ``ModelRunner.profile_run`` (device-agnostic, so it is tested on CPU too).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

GiB = 1024**3


@dataclass(frozen=True)
class MemoryProfile:
    """Bytes, measured on the device after loading weights and one profiling step."""

    total: int  # device memory
    free_at_start: int  # free before this engine loaded anything (other processes' use excluded)
    weights: int  # allocated by the model's parameters and buffers
    activation_peak: int  # peak allocated above the weights during the profiling step
    non_torch: int  # held outside the caching allocator (CUDA context, cuBLAS workspaces)
    graph_pool: int = 0  # estimated CUDA-graph pool (0 with enforce_eager)

    @property
    def non_kv(self) -> int:
        return self.weights + self.activation_peak + self.non_torch + self.graph_pool


def kv_budget(p: MemoryProfile, utilization: float) -> int:
    """Bytes the KV pool may take: ``utilization`` of the memory that was free when the engine
    started, minus everything else this engine uses.

    (vLLM takes the fraction of the GPU's *total* memory and fails when another process holds
    part of it; a fraction of the free memory gives the same pool on an idle GPU and still starts
    on a shared one.) Raises ValueError, with the numbers and what to change, when nothing is left.
    """
    requested = int(utilization * p.free_at_start)
    budget = requested - p.non_kv
    if budget <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache: gpu_memory_utilization={utilization} of the "
            f"{p.free_at_start / GiB:.2f} GiB free at start-up is {requested / GiB:.2f} GiB, but "
            f"the weights take {p.weights / GiB:.2f} GiB, the activation peak "
            f"{p.activation_peak / GiB:.2f} GiB, non-torch memory {p.non_torch / GiB:.2f} GiB "
            f"and CUDA graphs {p.graph_pool / GiB:.2f} GiB; raise --gpu-memory-utilization, "
            f"lower --max-num-batched-tokens / --max-num-seqs, use --enforce-eager, or a "
            f"smaller --dtype"
        )
    return budget


class MemoryProfiler:
    """Reads the device's memory counters around weight loading and the profiling steps.

    Usage: ``start()`` before loading weights, ``weights_loaded()`` after, then wrap each
    profiling step in ``step()`` / ``step_done(kind)``, and ``profile()`` at the end.
    """

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError("memory profiling reads CUDA counters; size a CPU KV pool with "
                             "kv_cache_memory or num_kv_blocks")
        self.device = device
        self._free0 = self._total = self._used0 = self._reserved0 = self._weights = 0
        self._allocated0 = 0
        self._base = 0
        self._peaks: dict[str, int] = {}

    def _used(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def start(self) -> None:
        """Before the weights load. Counters are process-wide: an earlier engine in this process
        (a dropped one that only the garbage collector can free, or a live one) must not count
        as this one's weights, so collect first and measure everything as growth from here."""
        gc.collect()
        torch.cuda.init()
        torch.cuda.empty_cache()
        self._free0, self._total = torch.cuda.mem_get_info(self.device)
        self._used0 = self._total - self._free0
        self._reserved0 = torch.cuda.memory_reserved(self.device)
        self._allocated0 = torch.cuda.memory_allocated(self.device)

    def weights_loaded(self) -> None:
        torch.cuda.synchronize(self.device)
        self._weights = torch.cuda.memory_allocated(self.device) - self._allocated0

    def step(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._base = torch.cuda.memory_allocated(self.device)

    def step_done(self, kind: str) -> None:
        torch.cuda.synchronize(self.device)
        self._peaks[kind] = torch.cuda.max_memory_allocated(self.device) - self._base

    def profile(self) -> MemoryProfile:
        torch.cuda.synchronize(self.device)
        reserved = torch.cuda.memory_reserved(self.device) - self._reserved0
        non_torch = max(0, self._used() - self._used0 - reserved)
        return MemoryProfile(
            total=self._total,
            free_at_start=self._free0,
            weights=self._weights,
            activation_peak=self._peaks.get("prefill", 0),
            non_torch=non_torch,
            graph_pool=self._peaks.get("decode", 0),
        )
