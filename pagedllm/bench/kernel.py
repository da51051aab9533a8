"""``bench kernel``: paged attention (an attention backend over block tables) vs contiguous SDPA.

Same data both ways: K/V of ``batch`` requests of ``context`` tokens, once scattered over a
shuffled block pool ``[num_blocks, block_size, Hkv, D]`` (paged), once laid out contiguously
``[batch, Hkv, context, D]``. Both sides write the step's new K/V first (paged: slot scatter;
contiguous: a slice copy), then attend:

- decode: one new token per request; contiguous = one SDPA call with the GQA group folded into
  the query axis ``q[batch, Hkv, group, D]`` (the fastest CPU formulation);
- prefill: one request, ``context`` new tokens, causal; contiguous = SDPA ``is_causal``, GQA
  (on CUDA, where no fused kernel takes GQA, e.g. fp32, K/V are kept expanded to the query
  heads instead of falling back to SDPA's math kernel: ``contiguous_impl`` says which).

Timing: ``rounds`` rounds, each ``iters`` calls of paged, of contiguous (and of the CPU-only
references below), interleaved (``bench.harness``: the order rotates every round); the median
round gives the per-call time. ratio = paged / contiguous.
On CUDA every timed loop is bracketed by ``torch.cuda.synchronize`` and each case is called once
before timing (Triton compiles on the first call).

Derived rates (``bench.device``): decode ``paged_GBps`` = K and V bytes read
(batch x context x Hkv x D x 2 x element size) / paged time, as a fraction of the GPU's spec
peak (``frac_peak``, None where the GPU is not in the table or on CPU) and of a measured
device copy (``frac_copy``); prefill ``paged_TFLOPs`` = causal attention FLOPs
(4 x Hq x D x L(L+1)/2) / time, and the same for contiguous SDPA.

CPU backend only: ``decode_path`` says which path ran, decode and prefill alike (``kernel``: the
C++ kernel that reads blocks in place; ``sdpa``: the fallback, PAGEDLLM_CPU_KERNELS=0 or no
compiler); ``gather_ms``
times the block-table gather of K and V alone (what the SDPA fallback copies into a dense tensor
before SDPA, the part of its paged time contiguous skips);
``contiguous_masked_ms`` is contiguous decode with the boolean length mask that a batch of ragged
lengths needs (the paged backend always masks batched decode): SDPA's masked path.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from pagedllm.args import EngineArgs
from pagedllm.bench.command import add_output_args, int_list, prepare, show
from pagedllm.bench.device import (
    attention_flops,
    decode_kv_bytes,
    device_name,
    is_cuda,
    measure_copy_bandwidth,
    peak_memory_bandwidth,
    require_device,
    synchronize,
)
from pagedllm.bench.harness import interleaved
from pagedllm.bench.kernel_case import Case, case
from pagedllm.bench.report import machine_info, targets
from pagedllm.choices import SUPPORTED_DTYPES as DTYPES
from pagedllm.config import normalize_dtype, normalize_kv_cache_dtype

BANDWIDTH_TARGET = 0.70  # decode KV bandwidth / spec peak at the longest context (issue 8)

COMMAND = "kernel"
HELP = ("paged attention vs contiguous SDPA, decode and prefill; on CUDA also decode bandwidth "
        "vs the GPU's peak and prefill TFLOP/s")
DESCRIPTION = ("Engine flags used: --device; --dtype (the K/V/Q dtype; auto: float32 on CPU, "
               "bfloat16 on CUDA); --model (head shapes from this checkpoint; default: the "
               "shipped model on CPU, 32 q / 8 kv heads, head_dim 128 on CUDA); "
               "--attention-backend (default: cpu on CPU, triton on CUDA; triton on CPU needs "
               "TRITON_INTERPRET=1 in the environment).")


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-heads", type=int, default=None)
    p.add_argument("--num-kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--contexts", type=int_list, default=None,
                   help="default: 128,512,2048 on CPU; 1024,4096,16384,32768 on CUDA")
    p.add_argument("--block-sizes", type=int_list, default=None, help="default: 16,64,256")
    p.add_argument("--batch", type=int, default=None,
                   help="decode batch (default: 16 on CPU, 32 on CUDA; prefill uses 1 request)")
    p.add_argument("--phases", default="decode,prefill")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--no-copy-bandwidth", dest="copy_bandwidth", action="store_false",
                   help="skip measuring the device copy bandwidth (the frac_copy reference)")
    add_output_args(p)
    EngineArgs.add_cli_args(p, only=("model", "dtype", "seed", "device", "attention_backend",
                                     "kv_cache_dtype"))
    p.add_argument("--backend", dest="attention_backend", help="= --attention-backend")


def run(a: argparse.Namespace) -> int:
    from pagedllm.bench.kernel_report import report_kernel

    prepare(a)
    d = kernel_defaults(a.device)
    heads = d["heads"] if d["heads"] and a.model is None else model_heads(a.model)
    res = run_kernel(
        contexts=tuple(a.contexts or d["contexts"]),
        block_sizes=tuple(a.block_sizes or d["block_sizes"]), batch=a.batch or d["batch"],
        phases=tuple(x.strip() for x in a.phases.split(",") if x.strip()),
        num_heads=a.num_heads or heads[0], num_kv_heads=a.num_kv_heads or heads[1],
        head_dim=a.head_dim or heads[2], rounds=a.rounds, iters=a.iters,
        backend=a.attention_backend, seed=a.seed, device=a.device,
        dtype=normalize_dtype(a.dtype, d["dtype"]), measure_copy=a.copy_bandwidth,
        kv_cache_dtype=normalize_kv_cache_dtype(a.kv_cache_dtype),
    )
    return show(report_kernel(res, a.output_dir, a.output_json, a.plot))


def model_heads(model: str | None) -> tuple[int, int, int]:
    """(q heads, kv heads, head_dim) of ``model``; (8, 2, 64) when no checkpoint is there."""
    from pagedllm.config import ModelConfig, default_model_path

    path = model or default_model_path()
    try:
        m = ModelConfig.from_hf(path)
    except ValueError:
        if model is not None:
            raise
        return 8, 2, 64
    return m.num_attention_heads, m.num_key_value_heads, m.head_dim


def kernel_defaults(device: str) -> dict[str, Any]:
    """Defaults by device. CPU: small shapes, fp32, heads from the shipped model (``heads``
    None); CUDA: a Llama-8B-like attention layer at serving sizes in bf16 on the Triton kernels."""
    if is_cuda(device):
        return dict(contexts=(1024, 4096, 16384, 32768), block_sizes=(16, 64, 256), batch=32,
                    heads=(32, 8, 128), dtype="bfloat16", backend="triton")
    return dict(contexts=(128, 512, 2048), block_sizes=(16, 64, 256), batch=16, heads=None,
                dtype="float32", backend="cpu")


def _time(fn: Callable[[], Any], iters: int, device: str) -> float:
    synchronize(device)
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    synchronize(device)
    return (time.perf_counter() - t) / iters


def run_kernel(
    contexts: tuple[int, ...] = (128, 512, 2048),
    block_sizes: tuple[int, ...] = (16, 64, 256),
    batch: int = 16,
    phases: tuple[str, ...] = ("decode", "prefill"),
    num_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    rounds: int = 5,
    iters: int = 10,
    backend: str | None = None,
    seed: int = 0,
    device: str = "cpu",
    dtype: str | None = None,
    measure_copy: bool = True,
    kv_cache_dtype: str = "auto",
) -> dict[str, Any]:
    """Time every (phase, context, block size) case; ``backend`` / ``dtype`` None take the
    device's defaults (``kernel_defaults``). ``kv_cache_dtype`` int8 / fp8_*: the paged side
    reads quantized K/V (values and per-token, per-head scales), the contiguous SDPA the same
    values dequantized to ``dtype`` (auto: K/V in ``dtype`` both ways)."""
    import torch

    defaults = kernel_defaults(device)
    backend = backend or defaults["backend"]
    dtype = dtype or defaults["dtype"]
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    require_device(device)
    heads = (num_heads, num_kv_heads, head_dim)
    kv_dtype = None if kv_cache_dtype == "auto" else kv_cache_dtype
    # bytes per K/V element the paged side reads: a quantized row adds its bf16 scale
    elem = (torch.empty(0, dtype=getattr(torch, dtype)).element_size() if kv_dtype is None
            else 1 + 2 / head_dim)
    name = device_name(device)
    peak = peak_memory_bandwidth(name)
    copy = measure_copy_bandwidth(device) if measure_copy else {"measured": False}
    rows: list[dict[str, Any]] = []
    with torch.inference_mode():
        for phase in phases:
            for ctx in contexts:
                for bs in block_sizes:
                    b = batch if phase == "decode" else 1
                    c = case(phase, b, ctx, bs, *heads, backend, seed, device, dtype, kv_dtype)
                    row = {"phase": phase, "context": ctx, "block_size": bs, "batch": b,
                           **_time_case(c, rounds, iters, device)}
                    row.update(_rates(phase, b, ctx, *heads, elem, row.pop("_paged_s"),
                                      row.pop("_contiguous_s"), peak, copy.get("bytes_per_s")))
                    rows.append(row)
                    del c
    return {
        "benchmark": "kernel",
        "backend": backend,
        "decode_path": _decode_path(backend),
        "device": device,
        "device_name": name,
        "shape": {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
                  "dtype": dtype, "kv_cache_dtype": kv_cache_dtype, "decode_batch": batch},
        "peak_bandwidth_bytes_per_s": peak,
        "peak_bandwidth_source": ("spec table, pagedllm.bench.device.PEAK_BANDWIDTH" if peak
                                  else "unknown (CPU, or a GPU not in the table)"),
        "copy_bandwidth": copy,
        "timing": {"rounds": rounds, "iters": iters, "order": "rotated per round",
                   "sync": "torch.cuda.synchronize around each timed loop" if is_cuda(device)
                   else "none (CPU)"},
        "results": rows,
        **_summary_and_targets(rows, phases, peak),
        "machine": machine_info(),
    }


def _time_case(c: Case, rounds: int, iters: int, device: str) -> dict[str, Any]:
    """Warm-up (Triton compiles here), then interleaved rounds (bench.harness): the median
    round's times and the paged / contiguous ratio."""
    extra = [f for f in (c.gather, c.masked) if f is not None]
    tp, tc, *te = interleaved([c.paged, c.contiguous, *extra], lambda f: _time(f, iters, device),
                              rounds, warmup=lambda f: f())
    tg = te.pop(0) if c.gather is not None else []
    tm = te.pop(0) if c.masked is not None else []
    p_s, c_s = statistics.median(tp), statistics.median(tc)
    ratios = [x / y for x, y in zip(tp, tc)]
    return {
        "paged_ms": 1e3 * p_s, "contiguous_ms": 1e3 * c_s,
        "gather_ms": 1e3 * statistics.median(tg) if tg else None,
        "contiguous_masked_ms": 1e3 * statistics.median(tm) if tm else None,
        "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
        "max_abs_diff": c.max_abs_diff, "contiguous_impl": c.contiguous_impl,
        "_paged_s": p_s, "_contiguous_s": c_s,
    }


def _decode_path(backend: str) -> str | None:
    """The CPU backend's path: its C++ kernel, or the SDPA fallback."""
    if backend != "cpu":
        return None
    from pagedllm import kernels

    return "kernel" if kernels.available() else "sdpa"


def _summary_and_targets(rows: list[dict[str, Any]], phases: tuple[str, ...],
                         peak: float | None) -> dict[str, Any]:
    summary = _summary(rows, phases)
    checks: list[tuple[str, float | None, str, float]] = [
        ("paged/contiguous decode time (worst case)",
         summary["decode"]["max_ratio"] if "decode" in summary else None, "<=", 1.3)]
    if peak is not None and "decode" in summary:
        longest = summary["decode"]["longest_context"]
        for bs, frac in summary["decode"]["frac_peak_at_longest"].items():
            checks.append((f"decode KV bandwidth / peak, context {longest}, block {bs}", frac,
                           ">=", BANDWIDTH_TARGET))
    return {"summary": summary, "targets": targets(checks)}


def _rates(phase: str, batch: int, context: int, hq: int, hkv: int, d: int, elem: float,
           paged_s: float, cont_s: float, peak: float | None,
           copy_bw: float | None) -> dict[str, Any]:
    """Decode: KV bytes read and GB/s (and fractions of peak / copy); prefill: FLOPs, TFLOP/s."""
    if phase == "decode":
        nbytes = decode_kv_bytes(batch, context, hkv, d, elem)
        bw = nbytes / paged_s
        return {"kv_bytes": nbytes, "paged_GBps": bw / 1e9,
                "contiguous_GBps": nbytes / cont_s / 1e9,
                "frac_peak": bw / peak if peak else None,
                "frac_copy": bw / copy_bw if copy_bw else None}
    flops = attention_flops(hq, d, context, context)
    return {"flops": flops, "paged_TFLOPs": flops / paged_s / 1e12,
            "contiguous_TFLOPs": flops / cont_s / 1e12}


def _summary(rows: list[dict[str, Any]], phases: tuple[str, ...]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for phase in phases:
        rs = [r for r in rows if r["phase"] == phase]
        if not rs:
            continue
        ratios = [r["ratio"] for r in rs]
        s: dict[str, Any] = {"median_ratio": statistics.median(ratios), "max_ratio": max(ratios)}
        longest = max(r["context"] for r in rs)
        at_longest = [r for r in rs if r["context"] == longest]
        if phase == "decode":
            s["longest_context"] = longest
            s["best_paged_GBps"] = max(r["paged_GBps"] for r in rs)
            s["paged_GBps_at_longest"] = {r["block_size"]: r["paged_GBps"] for r in at_longest}
            s["frac_peak_at_longest"] = {r["block_size"]: r["frac_peak"] for r in at_longest}
            s["frac_copy_at_longest"] = {r["block_size"]: r["frac_copy"] for r in at_longest}
        else:
            s["best_paged_TFLOPs"] = max(r["paged_TFLOPs"] for r in rs)
            s["best_contiguous_TFLOPs"] = max(r["contiguous_TFLOPs"] for r in rs)
        summary[phase] = s
    return summary
