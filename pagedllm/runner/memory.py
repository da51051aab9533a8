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
``MemoryProfiler`` reads the numbers from ``torch.cuda``; ``profile_run`` is the profiling step
(device-agnostic, so it is tested on CPU too).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedllm.layers.sampler import SamplingMetadata, sample
from pagedllm.runner.batch import build_host_batch, fetch
from pagedllm.runner.cuda_graph import capture_sizes

if TYPE_CHECKING:
    from pagedllm.runner.model_runner import ModelRunner

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


def profile_run(runner: ModelRunner, num_tokens: int, num_reqs: int) -> None:
    """One worst-case step against a throw-away KV cache: ``num_tokens`` new tokens over
    ``num_reqs`` requests starting at position 0, logits for every request, and sampling with
    top-k, top-p, min-p, penalties and 20 logprobs. Touches no engine state."""
    num_reqs = max(1, min(num_reqs, num_tokens))
    per, extra = divmod(num_tokens, num_reqs)
    q_lens = [per + (i < extra) for i in range(num_reqs)]
    bs = runner.block_size
    tables: list[list[int]] = []
    nxt = 0
    for q in q_lens:
        n = -(-q // bs)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    kv = runner.new_kv_cache(nxt)
    hb = build_host_batch([[0] * q for q in q_lens], [0] * num_reqs, tables, bs)
    b, dev, vocab = num_reqs, runner.device, runner.vocab_size
    with torch.inference_mode():
        ids, pos, meta = runner.uploader.metadata(hb)
        hidden = runner.run_forward(ids, pos, kv, meta)
        last = runner.uploader.upload([hb.q_start[1:] - 1])[0]
        logits = runner.model.compute_logits(hidden[last])
        md = SamplingMetadata(
            temperature=torch.ones(b, device=dev), all_greedy=False,
            top_k=torch.full((b,), 50, dtype=torch.long, device=dev),
            top_p=torch.full((b,), 0.9, device=dev), min_p=torch.full((b,), 0.05, device=dev),
            presence_penalty=torch.ones(b, device=dev),
            frequency_penalty=torch.ones(b, device=dev),
            repetition_penalty=torch.ones(b, device=dev),
            output_counts=torch.zeros(b, vocab, device=dev),
            prompt_mask=torch.zeros(b, vocab, dtype=torch.bool, device=dev),
            max_num_logprobs=20,
        )
        fetch([sample(logits, md).token_ids])
    del kv


def profile_memory(runner: ModelRunner, profiler: MemoryProfiler) -> MemoryProfile:
    """The profiling steps of a freshly loaded runner (no KV pool yet), measured."""
    sc = runner.config.scheduler
    profiler.step()
    profile_run(runner, sc.max_num_batched_tokens, sc.max_num_seqs)
    profiler.step_done("prefill")
    if runner.use_cuda_graphs:  # the graphs' pool holds the largest decode batch's activations
        g = capture_sizes(sc.max_num_seqs)[-1]
        profiler.step()
        profile_run(runner, g, g)
        profiler.step_done("decode")
    torch.cuda.empty_cache()
    return profiler.profile()
