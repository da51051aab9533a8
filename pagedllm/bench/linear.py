"""``bench linear``: time the engine spends in its linear layers, against the rate the same GEMMs
reach alone.

1. The engine runs the workload once (after a warm-up) with a timer on every ``Linear`` module
   (forward hooks, single process); each call is kept with its rows M, output N, input K and
   path (``Linear.kind``: pagedllm's GEMM or oneDNN on a packed weight, or F.linear).
2. Each distinct (M, N, K, dtype) is then timed alone, on oneDNN with a packed weight, on the
   engine's own GEMM where the engine ran it, and on
   F.linear, cycling over enough weight copies that they do not fit the CPU's caches (in the
   engine every layer's weight comes from memory, so warm weights would flatter the rate).
3. Per layer kind (qkv, o, gate_up, down, lm_head; from the model's shapes) the report gives the
   engine's time, its GFLOP/s, and ``efficiency`` = time alone on oneDNN / time in the engine:
   how close the engine's linears come to what oneDNN does on those shapes by themselves.
4. The machine's peak fp32 FMA rate at the kernels' ISA (``PAGEDLLM_ISA``; a register-only FMA
   loop on every thread, ``torch.ops.pagedllm.gemm_fma_peak``) and each kind's ``of_peak``:
   the engine's GFLOP/s over it.
5. The machine's memory read rate (every thread reading its share of a 1 GiB buffer,
   ``torch.ops.pagedllm.gemm_read_bandwidth``) and each kind's ``of_roofline``: the time the
   calls would take at the roofline (each call the longer of its flops at the peak and its
   weight bytes at the read rate; activations are not counted) over the engine's time. At the
   few rows of a decode step a linear reads its whole weight for a few flops per byte, so no
   kernel reaches the FMA peak there; ``of_roofline`` says how close it comes to what the
   machine allows (above 1 where the weights come from cache, as a small model's can).

Both sides use the median call of a shape (engine: per shape, times its call count), so that a
call another process delayed on a shared machine weighs on neither; the engine's plain total is
reported too (``engine_total_s``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedllm.bench.command import add_workload_command_args, show, workload
from pagedllm.bench.report import format_table, machine_info, write_json
from pagedllm.bench.workload import BenchRequest, WorkloadSpec, summarize

if TYPE_CHECKING:  # torch is imported where it runs: the CLI builds this parser without it
    import torch

LINEAR_OPS = {"mkldnn::_linear_pointwise": "onednn", "aten::linear": "torch"}
COLD_BYTES = 64 * 2**20  # weight copies cycled through when timing alone: more than any L3 here
Shape = tuple[int, int, int]  # (M, N, K)

COMMAND = "linear"
HELP = "time in the engine's linear layers vs the GEMM rate oneDNN reaches alone on the same shapes"


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--warmup", type=int, default=4, help="requests in the warm-up run")
    add_workload_command_args(p, 16)


def run(a: argparse.Namespace) -> int:
    kw, spec, reqs, _ = workload(a)
    return show(report_linear(run_linear(reqs, spec, kw, a.warmup), a.output_dir, a.output_json))


def layer_kinds(cfg: Any) -> dict[tuple[int, int], str]:
    """(N, K) of each linear of a Llama-family model -> its name (joined when shapes coincide)."""
    d, h = cfg.head_dim, cfg.hidden_size
    shapes = {
        "qkv": ((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d, h),
        "o": (h, cfg.num_attention_heads * d),
        "gate_up": (2 * cfg.intermediate_size, h),
        "down": (h, cfg.intermediate_size),
        "lm_head": (cfg.vocab_size, h),
    }
    kinds: dict[tuple[int, int], str] = {}
    for name, nk in shapes.items():
        kinds[nk] = f"{kinds[nk]}+{name}" if nk in kinds else name
    return kinds


def time_linears(engine_backend: Any, reqs: list[BenchRequest]) -> tuple[dict[tuple[Shape, str], list[float]], float]:
    """Run ``reqs`` once with a timer on every ``Linear`` (forward hooks); -> ({((M, N, K),
    path): [seconds of each call]}, wall seconds of the run). Path "onednn": the layer has a
    packed weight; "torch": F.linear."""
    from pagedllm.layers.linear import Linear

    calls: dict[tuple[Shape, str], list[float]] = defaultdict(list)
    started: list[float] = []

    def before(m: Any, args: Any) -> None:
        started.append(time.perf_counter())

    def after(m: Any, args: Any, out: torch.Tensor) -> None:
        dt = time.perf_counter() - started.pop()
        x = args[0]
        shape = (x.numel() // x.shape[-1], m.out_features, m.in_features)
        calls[(shape, m.kind)].append(dt)

    mods = [m for m in engine_backend.engine.runner.model.modules() if isinstance(m, Linear)]
    handles = [h for m in mods for h in (m.register_forward_pre_hook(before),
                                          m.register_forward_hook(after))]
    try:
        t0 = time.perf_counter()
        engine_backend.run(reqs)
        wall = time.perf_counter() - t0
    finally:
        for h in handles:
            h.remove()
    return dict(calls), wall


def time_alone(shape: Shape, dtype: torch.dtype, path: str, min_s: float = 0.02,
               max_reps: int = 50, weight_dtype: torch.dtype | None = None) -> float:
    """Median seconds of one call of ``shape`` on ``path``, weights cold (see module doc);
    ``weight_dtype``: the GEMM's 16-bit weights of a float32 layer (gemm_w16.cpp)."""
    import torch
    from torch.nn import functional as F

    m, n, k = shape
    copies = max(1, min(32, -(-COLD_BYTES // (n * k * dtype.itemsize))))
    ws = [torch.randn(n, k).mul_(0.02).to(dtype) for _ in range(copies)]
    x = torch.randn(m, k).to(dtype)
    if path == "onednn":
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in ws]

        def call(i: int) -> None:
            torch.ops.mkldnn._linear_pointwise(x, packed[i], None, "none", [], "")
    elif path == "gemm":
        panels = [torch.ops.pagedllm.pack_gemm_weight(w) if weight_dtype is None
                  else torch.ops.pagedllm.pack_gemm_weight_w16(w.to(weight_dtype)) for w in ws]

        def call(i: int) -> None:
            torch.ops.pagedllm.gemm_packed(x, panels[i], n, None)
    else:
        def call(i: int) -> None:
            F.linear(x, ws[i])
    times: list[float] = []
    with torch.inference_mode():
        call(0)
        while len(times) < max_reps and (len(times) < 5 or sum(times) < min_s):
            t0 = time.perf_counter()
            call(len(times) % copies)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_linear(reqs: list[BenchRequest], spec: WorkloadSpec, engine_kwargs: dict[str, Any],
               warmup: int = 4) -> dict[str, Any]:
    import torch

    from pagedllm import kernels
    from pagedllm.bench.baselines import EngineBackend

    # the hooks need the layers' modules called one by one; the two-op decoder layer runs the
    # same linear calls (kernels/csrc/decoder_layer.cpp)
    backend = EngineBackend("pagedllm", {**engine_kwargs, "fused_layers": False})
    cfg = backend.engine.config.model
    dtype = getattr(torch, cfg.dtype)
    w16 = getattr(torch, cfg.weight_dtype) if cfg.weight_dtype else None
    if warmup:
        backend.run(reqs[:warmup])
    calls, wall = time_linears(backend, reqs)
    kinds = layer_kinds(cfg)
    alone: dict[tuple[Shape, str], float] = {}
    for shape, path in calls:
        for p in ("onednn", "torch", "gemm"):
            runs = {"torch": True, "onednn": dtype in _onednn(), "gemm": path == "gemm"}[p]
            if (shape, p) not in alone and runs:
                alone[(shape, p)] = time_alone(shape, dtype, p, weight_dtype=w16 if p == "gemm" else None)
    agg: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    peak, bw = fma_peak(), read_bandwidth()
    for (shape, path), ts in calls.items():
        m, n, k = shape
        for key in (kinds.get((n, k), f"{n}x{k}"), "all linears"):
            a = agg[key]
            a["calls"] += len(ts)
            a["engine_total_s"] += sum(ts)
            a["engine_s"] += statistics.median(ts) * len(ts)
            a["gflop"] += 2 * m * n * k * len(ts) / 1e9
            a["rows"] += m * len(ts)
            a["roofline_s"] += floor_s(2 * m * n * k, weight_bytes(shape, path, w16 or dtype),
                                       peak, bw) * len(ts)
            for p in ("onednn", "torch", "gemm"):
                a[f"{p}_alone_s"] += alone.get((shape, p), float("nan")) * len(ts)
    rows = []
    for kind, a in sorted(agg.items(), key=lambda kv: kv[0] == "all linears"):
        rows.append({
            "layer": kind, "calls": int(a["calls"]), "mean_rows": a["rows"] / a["calls"],
            "engine_s": a["engine_s"], "engine_total_s": a["engine_total_s"], "engine_gflops": a["gflop"] / a["engine_s"],
            "onednn_alone_gflops": a["gflop"] / a["onednn_alone_s"],
            "torch_alone_gflops": a["gflop"] / a["torch_alone_s"],
            "gemm_alone_gflops": a["gflop"] / a["gemm_alone_s"],
            "efficiency": a["onednn_alone_s"] / a["engine_s"],
        })
    for row in rows:
        a = agg[str(row["layer"])]
        row["of_peak"] = float(row["engine_gflops"]) / peak if peak else float("nan")  # type: ignore[arg-type]
        row["of_roofline"] = a["roofline_s"] / a["engine_s"]
    paths = sorted({p for _, p in calls})
    return {
        "benchmark": "linear",
        "dtype": cfg.dtype,
        "weight_dtype": cfg.weight_dtype or cfg.dtype,
        "threads": torch.get_num_threads(),
        "isa": kernels.isa(),
        "fma_peak_gflops": peak,
        "read_bandwidth_gbps": bw,
        "engine_paths": paths,
        "run_s": wall,
        "linear_share_of_run": agg["all linears"]["engine_total_s"] / wall if calls else 0.0,
        "results": rows,
        "shapes": [{"m": s[0], "n": s[1], "k": s[2], "path": p, "calls": len(ts),
                    "engine_total_s": sum(ts), "engine_median_s": statistics.median(ts),
                    "onednn_alone_s": alone.get((s, "onednn")),
                    "torch_alone_s": alone.get((s, "torch")),
                    "gemm_alone_s": alone.get((s, "gemm"))}
                   for (s, p), ts in sorted(calls.items())],
        "workload": {**spec.describe(), **summarize(reqs)},
        "engine": {k: v for k, v in engine_kwargs.items() if v is not None},
        "machine": machine_info(),
    }


def weight_bytes(shape: Shape, path: str, weight_dtype: torch.dtype) -> int:
    """Bytes of weight one call of ``shape`` on ``path`` reads: pagedllm's GEMM reads panels of
    32 output columns (the last one padded)."""
    _, n, k = shape
    return (-(-n // 32) * 32 if path == "gemm" else n) * k * weight_dtype.itemsize


def floor_s(flops: float, weight: float, peak: float | None, bw: float | None) -> float:
    """Seconds a call of ``flops`` reading ``weight`` bytes takes at the roofline: the longer of
    its flops at ``peak`` GFLOP/s and its weight at ``bw`` GB/s; NaN without the measures."""
    if not peak or not bw:
        return float("nan")
    return max(flops / peak, weight / bw) / 1e9


def read_bandwidth(reps: int = 5) -> float | None:
    """The machine's memory read rate in GB/s (all threads, the kernels' vector loads; the best
    of ``reps`` reads of a 1 GiB buffer: a 64-256 MiB one read 1.2-1.5x faster here, from a
    large L3 in part); None without the kernels."""
    import torch

    from pagedllm import kernels

    if not kernels.available():
        return None
    return float(torch.ops.pagedllm.gemm_read_bandwidth(1 << 30, reps))


def fma_peak(reps: int = 3) -> float | None:
    """The machine's peak fp32 GFLOP/s at the kernels' ISA, the best of ``reps`` register-only
    FMA loops of ~0.1 s on every thread (load only ever lowers it); None without the kernels."""
    import torch

    from pagedllm import kernels

    if not kernels.available():
        return None
    ops = torch.ops.pagedllm
    iters = max(10_000, int(0.1 * ops.gemm_fma_peak(100_000) * 1e9 / (2 * 16 * 16 * torch.get_num_threads())))
    return max(ops.gemm_fma_peak(iters) for _ in range(reps))


def _onednn() -> tuple[torch.dtype, ...]:
    from pagedllm.layers.linear import onednn_dtypes

    return onednn_dtypes()


def report_linear(res: dict[str, Any], output_dir: Path, output_json: Path | None) -> list[Path]:
    print(f"dtype {res['dtype']} (weights {res['weight_dtype']}), {res['threads']} threads, "
          f"engine path {'+'.join(res['engine_paths'])}; "
          f"linears {res['linear_share_of_run']:.0%} of the profiled run ({res['run_s']:.2f} s)")
    if res["fma_peak_gflops"]:
        print(f"peak FMA rate ({res['isa']}, register-only loop, {res['threads']} threads): "
              f"{res['fma_peak_gflops']:.1f} GFLOP/s; of_peak = engine GFLOP/s / peak")
    if res.get("read_bandwidth_gbps"):
        print(f"memory read rate ({res['threads']} threads): {res['read_bandwidth_gbps']:.1f} "
              "GB/s; of_roofline = time at the roofline (flops at peak or weight bytes at the "
              "read rate, the longer) / engine time")
    print(format_table(res["results"], ("layer", "calls", "mean_rows", "engine_total_s", "engine_gflops",
                                        "onednn_alone_gflops", "torch_alone_gflops", "gemm_alone_gflops",
                                        "efficiency", "of_peak", "of_roofline"),
                       ["layer", "calls", "mean M", "engine total s", "engine GFLOP/s",
                        "oneDNN alone", "F.linear alone", "pagedllm GEMM alone", "efficiency",
                        "of peak", "of roofline"]))
    return [write_json(output_json or output_dir / "linear.json", res)]
