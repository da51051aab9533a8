"""CUDA graphs for decode steps: one captured forward per batch-size bucket, replayed.

A decode-only step of B requests (one new token each) is padded up to the next captured size G
and replayed from static buffers; prefill and mixed steps, and batches larger than the largest
bucket, run eagerly. Sizes: 1, 2, 4, then every multiple of 8 up to ``max_num_seqs`` (and
``max_num_seqs`` itself), so padding costs at most 7 rows past 8.

Static input (device, int64), the layout of a G-row step::

    static[: G * (5 + W)] = [ ids[G] | positions[G] | slots[G] | seq_lens[G] | adapters[G]
                              | tables^T[W, G] ]

``W`` = blocks of one ``max_model_len`` request. The tables are stored transposed (column j of
every row together), so a step whose longest table has ``w`` blocks fills and copies only the
first ``G * (5 + w)`` elements; columns past ``w`` hold stale block ids that the kernels never
read (they stop at seq_lens). One pinned host buffer of the same layout is filled per step and
copied with one non-blocking copy; the captured graph itself slices it, transposes the tables
and casts seq_lens / tables to int32, so a replay is: fill, copy, ``graph.replay()``.

Padding rows repeat row 0 (same token, position, slot, table): they recompute row 0's K/V and
write the same values to row 0's slot, so no block is touched that the batch does not own, and
every backend works unchanged. Their outputs are dropped.

LoRA (``lora``: the runner's ``LoRAManager``, when adapters are enabled): every graph records each
adapted linear's delta with the step's per-row adapter slots read from the ``adapters`` row
(``LoRAMapping`` over the slot stacks, which stay at one address: a slot load copies into them).
A row without an adapter reads the base slot, all zeros, so steps with and without adapters
replay the same graphs. The recorded method is one that needs no host data: the Triton kernels on
CUDA, "gather" (``torch.bmm`` over gathered slots) on CPU, where ``capture=False`` tests it.

Attention metadata in a graph is static: ``max_seq_len`` is ``max_model_len`` (the decode
kernel's split-K grid is fixed at capture) and the host lists are the capture-time values, so
only backends that set ``supports_cuda_graphs`` (they read neither in a decode-only step) may be
captured. The captured graphs hold the KV cache's addresses: after the pool is resized they are
captured again (``KVCache.generation`` tells).

``capture=False`` runs exactly the same padded static-buffer forward eagerly instead of
recording it; it exists so the bucketing, padding and buffer layout are tested on CPU, where
CUDA graphs cannot run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.attention import AttentionMetadata
from pagedllm.logging_utils import init_logger
from pagedllm.lora.ops import LoRAMapping
from pagedllm.runner.batch import HostBatch
from pagedllm.runner.kv_cache import KVCache

if TYPE_CHECKING:
    from pagedllm.lora.manager import LoRAManager

logger = init_logger(__name__)

# (input_ids [T], positions [T], kv_cache, meta) -> hidden [T, hidden]
Forward = Callable[[torch.Tensor, torch.Tensor, KVCache, AttentionMetadata], torch.Tensor]
ROWS = 5  # ids, positions, slots, seq_lens, adapters: the per-row fields before the tables


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return sizes + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, forward: Forward, kv_cache: KVCache, max_num_seqs: int,
                 max_model_len: int, block_size: int, device: torch.device,
                 capture: bool = True, lora: LoRAManager | None = None) -> None:
        self.forward = forward
        self.lora = lora  # adapters recorded in every graph (None: no LoRA in this engine)
        self.base_slot = 0 if lora is None else lora.base_slot
        self.kv_cache = kv_cache
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self.width = -(-max_model_len // block_size)
        self.device = device
        self.capture = capture
        gmax = self.sizes[-1]
        n = gmax * (ROWS + self.width)
        self.static = torch.zeros(n, dtype=torch.int64, device=device)
        self.host = torch.zeros(n, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._copied: torch.cuda.Event | None = None  # the last host->static copy (batch.py)
        self.arange = torch.arange(gmax + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # G -> hidden [G, hidden] (graph-owned)
        self.pool: object | None = None
        self._stream: torch.cuda.Stream | None = None  # side stream for every capture
        self.generation = -1
        self.replays = 0  # decode steps served from the graphs (for tests and logs)

    def bucket(self, num_reqs: int) -> int | None:
        for s in self.sizes:
            if s >= num_reqs:
                return s
        return None

    def can_run(self, hb: HostBatch, lora: LoRAMapping | None = None) -> bool:
        """A decode-only step that fits a bucket, with adapters only if the graphs record them."""
        return (hb.is_decode_only and self.bucket(hb.num_reqs) is not None
                and (lora is None or self.lora is not None))

    # -- the recorded computation ---------------------------------------------------------------
    def _static_forward(self, g: int, seq_lens_cpu: list[int]) -> torch.Tensor:
        w = self.width
        flat = self.static[: g * (ROWS + w)]
        ids, pos, slots = flat[:g], flat[g : 2 * g], flat[2 * g : 3 * g]
        meta = AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=self.arange[: g + 1],
            seq_lens=flat[3 * g : 4 * g].to(torch.int32),
            block_tables=flat[ROWS * g :].view(w, g).t().to(torch.int32).contiguous(),
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc_cpu=list(range(g + 1)),
            seq_lens_cpu=seq_lens_cpu,
        )
        if self.lora is not None:  # every adapted linear, each row's slot from the adapters row
            method = "triton" if self.device.type == "cuda" else "gather"
            meta.lora = LoRAMapping(flat[4 * g : 5 * g], [], self.lora.stacks, method)
        return self.forward(ids, pos, self.kv_cache, meta)

    def capture_all(self, warmup: bool = True) -> None:
        """Record every bucket, largest first (they share one memory pool). ``warmup`` runs each
        bucket eagerly twice first (Triton compiles, cuBLAS picks its kernels); those runs write
        block 0's first slot, so they happen only at start-up, while the cache is empty —
        recording itself executes nothing."""
        self.graphs.clear()
        self.outputs.clear()
        self.static.zero_()  # no stale block id from a larger pool survives a resize
        self.generation = self.kv_cache.generation
        if not self.capture:
            return
        self.pool = torch.cuda.graph_pool_handle()
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.inference_mode(), torch.cuda.stream(stream):
            for g in reversed(self.sizes):
                placeholder = [self.max_model_len] * g
                self._fill_dummy(g)
                for _ in range(2 if warmup else 0):
                    self._static_forward(g, placeholder)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    self.outputs[g] = self._static_forward(g, placeholder)
                self.graphs[g] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def _fill_dummy(self, g: int) -> None:
        """Capture-time inputs: every row token 0 at position 0, slot 0 of block 0 (block 0's
        first slot gets written during warm-up; the cache is empty at start-up)."""
        w = self.width
        self.static[: g * (ROWS + w)].zero_()
        self.static[3 * g : 4 * g].fill_(1)
        self.static[4 * g : 5 * g].fill_(self.base_slot)

    # -- a step -----------------------------------------------------------------------------------
    def run(self, hb: HostBatch, lora: LoRAMapping | None = None) -> torch.Tensor:
        """hidden [B, hidden] of a decode-only host batch with the adapters of ``lora`` (None:
        the base model for every row), where ``can_run(hb, lora)``."""
        assert lora is None or (self.lora is not None and lora.host_slots is not None)
        if self.generation != self.kv_cache.generation:
            logger.info("KV pool resized: capturing the decode CUDA graphs again")
            self.capture_all(warmup=False)
        b = hb.num_reqs
        g = self.bucket(b)
        assert g is not None and hb.is_decode_only
        if self._copied is not None:
            self._copied.synchronize()
        tw = hb.tables.shape[1]
        n = g * (ROWS + tw)
        host = self.host.numpy()[:n]
        pad = np.zeros(g, dtype=np.int64)  # padding rows repeat row 0
        rows = (np.full(b, self.base_slot, dtype=np.int64)
                if lora is None or lora.host_slots is None else lora.host_slots.numpy())
        for k, col in enumerate((hb.input_ids, hb.positions, hb.slots, hb.seq_lens, rows)):
            pad[:b], pad[b:] = col, col[0]
            host[k * g : (k + 1) * g] = pad
        tables_t = host[ROWS * g :].reshape(tw, g)  # transposed, first tw columns only
        tables_t[:, :b] = hb.tables.T
        tables_t[:, b:] = hb.tables[0][:, None]
        self.static[:n].copy_(self.host[:n], non_blocking=self.capture)
        self.replays += 1
        if self.capture:
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            seq = hb.seq_lens.tolist()
            return self._static_forward(g, seq + [seq[0]] * (g - b))[:b]
        self.graphs[g].replay()
        return self.outputs[g][:b]
