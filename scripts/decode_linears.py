"""The linears of one decode step, alone: every layer's qkv, o, gate_up and down and the LM head
of a Llama config, on random weights packed as the engine packs them (pagedllm's GEMM), called
in the engine's order at M rows. The weights (~400 MB for the 125M model in float32) are far
larger than the caches, so each call streams its weight from memory, as a decode step does.
Prints, per M, the fastest and median of the reps: the step's time, its weight bytes/s and
GFLOP/s, and the LM head's alone; first the rate two threads read the same bytes at (a sum).

    python scripts/decode_linears.py MODEL_DIR [--dtype float32] [--rows 1,8,15,16,24,32]
        [--reps 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import pagedllm  # noqa: F401  (its import sets torch's huge-page allocation, as the engine runs)
from pagedllm import kernels


def shapes(config: dict) -> list[tuple[int, int]]:
    """(N, K) of each linear of a decode step, in the order the engine calls them."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    hd = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    layer = [(q + 2 * kv, h), (h, q), (2 * inter, h), (h, inter)]
    return layer * config["num_hidden_layers"] + [(config["vocab_size"], h)]


def read_rate(weights: list[torch.Tensor]) -> float:
    """Seconds for torch to sum every weight (its threads split each tensor)."""
    t0 = time.perf_counter()
    for w in weights:
        w.sum()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rows", default="1,8,15,16,24,32")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    if not kernels.available():
        raise SystemExit(f"pagedllm's CPU kernels did not build: {kernels.unavailable_reason()}")
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    config = json.loads((a.model / "config.json").read_text())
    sh = shapes(config)
    g = torch.Generator().manual_seed(0)
    packed = [torch.ops.pagedllm.pack_gemm_weight((torch.randn(n, k, generator=g) * 0.02).to(dtype))
              for n, k in sh]
    size = torch.finfo(dtype).bits // 8
    nbytes = sum(n * k for n, k in sh) * size
    best = min(read_rate(packed) for _ in range(a.reps))
    print(f"{len(sh)} linears, {nbytes / 1e6:.1f} MB of {a.dtype} weights; read by {a.threads} "
          f"threads (sum): {best * 1e3:.2f} ms, {nbytes / best / 1e9:.1f} GB/s")
    rows = [int(r) for r in a.rows.split(",")]
    xs = {k: torch.randn(max(rows), k, generator=g).to(dtype) for k in {k for _, k in sh}}
    head_n, head_k = sh[-1]
    for m in rows:
        step, head = [], []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            for (n, k), w in zip(sh[:-1], packed[:-1]):
                torch.ops.pagedllm.gemm_packed(xs[k][:m], w, n, None)
            t1 = time.perf_counter()
            torch.ops.pagedllm.gemm_packed(xs[head_k][:m], packed[-1], head_n, None)
            t2 = time.perf_counter()
            step.append(t2 - t0)
            head.append(t2 - t1)
        s, hb = min(step), min(head)
        print(f"M={m:5d} step {s * 1e3:8.2f} ms (median {statistics.median(step) * 1e3:8.2f}): "
              f"{nbytes / s / 1e9:5.1f} GB/s, {2 * m * nbytes / size / s / 1e9:4.0f} GFLOP/s; "
              f"LM head {hb * 1e3:6.2f} ms ({head_n * head_k * size / hb / 1e9:5.1f} GB/s)", flush=True)


if __name__ == "__main__":
    main()
