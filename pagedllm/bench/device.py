"""Device helpers for the benchmarks: clock-safe synchronisation, the GPU memory-bandwidth spec
table, a measured copy bandwidth, and the byte / FLOP arithmetic of attention.

Everything here is importable without a GPU; torch is imported inside the functions.
"""

from __future__ import annotations

import re
import time
from typing import Any

# Spec-sheet peak DRAM bandwidth, bytes/s, by GPU. Matched against the words of
# ``torch.cuda.get_device_name()`` (lower-cased, split on anything not a letter or digit): a row
# applies when all its words occur, first match wins, so more specific rows come first
# ("a100 80gb pcie" before "a100 80gb" before "a100"; whole words keep "a10" off "a100" and
# "l4" off "l40s").
PEAK_BANDWIDTH: tuple[tuple[tuple[str, ...], float], ...] = (
    (("h200",), 4.8e12),
    (("h100", "pcie"), 2.0e12),
    (("h100", "nvl"), 3.9e12),
    (("h100",), 3.35e12),  # SXM5 ("NVIDIA H100 80GB HBM3")
    (("a100", "80gb", "pcie"), 1.935e12),
    (("a100", "80gb"), 2.039e12),  # SXM4
    (("a100",), 1.555e12),  # 40GB, SXM4 and PCIe
    (("l4",), 3.0e11),
    (("a10",), 6.0e11),
    (("a10g",), 6.0e11),
    (("rtx", "4090"), 1.008e12),
)


def peak_memory_bandwidth(device_name: str | None) -> float | None:
    """The spec peak bandwidth (bytes/s) of a GPU by its CUDA device name; None if unknown."""
    if not device_name:
        return None
    words = set(re.split(r"[^a-z0-9]+", device_name.lower()))
    for keys, bw in PEAK_BANDWIDTH:
        if all(k in words for k in keys):
            return bw
    return None


def is_cuda(device: str) -> bool:
    return str(device).startswith("cuda")


def require_device(device: str) -> None:
    """A ValueError that says what to do when ``device`` is CUDA and torch sees no GPU."""
    import torch

    if is_cuda(device) and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but torch {torch.__version__} sees no CUDA GPU; "
                         f"run on a GPU machine with a CUDA build of torch, or use --device cpu")


def device_name(device: str) -> str | None:
    """``torch.cuda.get_device_name`` for a CUDA device, None for CPU."""
    if not is_cuda(device):
        return None
    import torch

    return str(torch.cuda.get_device_name(torch.device(device)))


def synchronize(device: str) -> None:
    """Wait for queued GPU work before reading a clock (no-op on CPU)."""
    if is_cuda(device):
        import torch

        torch.cuda.synchronize(torch.device(device))


def measure_copy_bandwidth(device: str, nbytes: int | None = None, iters: int | None = None,
                           ) -> dict[str, Any]:
    """Achievable bandwidth of ``dst.copy_(src)`` on ``device``, counted as read + write bytes
    (2 x ``nbytes`` per copy): the practical ceiling a memory-bound kernel is compared against.
    Defaults: 1 GiB x 20 copies on CUDA, 64 MiB x 5 on CPU. The best of three timed loops."""
    import torch

    cuda = is_cuda(device)
    nbytes = nbytes or (2**30 if cuda else 2**26)
    iters = iters or (20 if cuda else 5)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up (allocation, first-touch)
    best = float("inf")
    for _ in range(3):
        synchronize(device)
        t = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - t)
    del src, dst
    return {"bytes_per_copy": nbytes, "iters": iters, "counted": "read + write",
            "bytes_per_s": 2 * nbytes * iters / best}


def decode_kv_bytes(batch: int, context: int, num_kv_heads: int, head_dim: int,
                    elem_size: float) -> float:
    """Bytes of K and V one decode step reads: every request's whole context, both caches
    (``elem_size`` per element; a quantized row's scale spread over its elements)."""
    return batch * context * num_kv_heads * head_dim * 2 * elem_size


def attention_flops(num_heads: int, head_dim: int, query_len: int, seq_len: int) -> int:
    """FLOPs of causal attention for ``query_len`` new tokens at the end of a ``seq_len``-token
    context: each query row at position p sees p + 1 keys, and each (query, key) pair costs
    2 * D for QK^T and 2 * D for PV, per query head. Row i of the new tokens (p = seq_len -
    query_len + i) sees seq_len - query_len + i + 1 keys, so the keys seen sum to
    ``query_len * seq_len - query_len * (query_len - 1) / 2``; a full prefill (query_len =
    seq_len = L) gives L(L+1)/2, a decode step (query_len 1) gives seq_len."""
    if not 0 < query_len <= seq_len:
        raise ValueError(f"need 0 < query_len <= seq_len, got {query_len}, {seq_len}")
    keys = query_len * seq_len - query_len * (query_len - 1) // 2
    return 4 * num_heads * head_dim * keys
