"""``bench throughput``: offline generation of one workload on several backends, interleaved.

Every backend is built once (weights loaded, KV pool allocated), warmed up on a few requests,
then the workload runs ``reps`` times per backend in rotated order (rep r starts at backend r),
so that machine load drifts hit all backends alike. Rates come from each backend's fastest
repetition (on a shared machine, load only ever adds time, so the minimum is the least noisy
estimate of the backend's own cost); the median time is kept in the JSON as well.

All backends run on the engine kwargs' ``device`` (``--device cuda``: the engine, the contiguous
baseline and HF generate on the same GPU; see ``baselines`` for the dtype HF uses).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from pagedllm.bench.baselines import RunResult, make_backend
from pagedllm.bench.device import device_name
from pagedllm.bench.report import (
    format_table,
    machine_info,
    plot,
    print_targets,
    targets,
    write_json,
)
from pagedllm.bench.workload import BenchRequest, WorkloadSpec, summarize

COLUMNS = ("backend", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s", "elapsed_s",
           "peak_running", "kv_utilization")


def run_throughput(
    reqs: list[BenchRequest],
    spec: WorkloadSpec,
    engine_kwargs: dict[str, Any],
    backends: list[str],
    reps: int = 3,
    hf_batch_size: int = 16,
    warmup: int = 4,
) -> dict[str, Any]:
    built = [make_backend(b, engine_kwargs, hf_batch_size) for b in backends]
    for b in built:
        if warmup:
            b.run(reqs[:warmup])
    runs: dict[str, list[RunResult]] = {b: [] for b in backends}
    for rep in range(reps):
        order = built[rep % len(built):] + built[:rep % len(built)]
        for b in order:
            runs[b.name].append(b.run(reqs))

    results = []
    for name in backends:
        rs = runs[name]
        best = min(rs, key=lambda r: r.elapsed_s)  # the fastest repetition (module docstring)
        t = best.elapsed_s
        row: dict[str, Any] = {
            "backend": name,
            "requests_per_s": best.num_requests / t,
            "output_tokens_per_s": best.output_tokens / t,
            "total_tokens_per_s": (best.prompt_tokens + best.output_tokens) / t,
            "elapsed_s": t,
            "elapsed_s_all": [r.elapsed_s for r in rs],
            "elapsed_s_median": statistics.median(r.elapsed_s for r in rs),
            "elapsed_s_spread": (max(r.elapsed_s for r in rs) - min(r.elapsed_s for r in rs)) / t,
            "num_requests": best.num_requests,
            "prompt_tokens": best.prompt_tokens,
            "output_tokens": best.output_tokens,
            "generated_tokens": best.generated_tokens,
            **best.stats,
        }
        results.append(row)

    ref = "pagedllm" if "pagedllm" in backends else backends[0]
    by = {r["backend"]: r for r in results}
    ratios = {
        f"{ref}/{name}": {k: by[ref][k] / by[name][k] for k in
                          ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s")}
        for name in backends if name != ref
    }
    first = {name: runs[name][0].outputs for name in backends}
    agreement = {
        f"{ref}/{name}": _match(first[ref], first[name]) for name in backends if name != ref
    }
    checks = []
    if ref == "pagedllm":
        for name, want in (("hf", 3.0), ("contiguous", 2.0)):
            if name in by:
                checks.append((f"pagedllm/{name} output tokens/s",
                               ratios[f"pagedllm/{name}"]["output_tokens_per_s"], ">=", want))
    device = str(engine_kwargs.get("device") or "cpu")
    return {
        "benchmark": "throughput",
        "device": device,
        "device_name": device_name(device),
        "results": results,
        "ratios": ratios,
        "greedy_output_agreement": agreement,
        "targets": targets(checks),
        "reps": reps,
        "order": "interleaved: rep r runs backends rotated by r",
        "hf_batch_size": hf_batch_size if "hf" in backends else None,
        "workload": {**spec.describe(), **summarize(reqs)},
        "engine": {k: v for k, v in engine_kwargs.items() if v is not None},
        "machine": machine_info(),
    }


def _match(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of requests whose greedy outputs are identical."""
    return sum(x == y for x, y in zip(a, b)) / len(a) if a else 1.0


def report_throughput(res: dict[str, Any], output_dir: Path, output_json: Path | None,
                      make_plots: bool = True) -> list[Path]:
    dtype = res["engine"].get("dtype", "auto")
    print(f"device {res.get('device_name') or res.get('device', 'cpu')}, dtype {dtype}")
    print(format_table(res["results"], COLUMNS,
                       ["backend", "req/s", "out tok/s", "total tok/s", "time s", "peak run",
                        "KV util"]))
    for pair, r in res["ratios"].items():
        print(f"{pair}: output tok/s x{r['output_tokens_per_s']:.2f}, "
              f"requests/s x{r['requests_per_s']:.2f}, total tok/s x{r['total_tokens_per_s']:.2f}")
    for pair, m in res["greedy_output_agreement"].items():
        print(f"greedy outputs identical {pair}: {m:.0%}")
    print_targets(res["targets"])
    paths = [write_json(output_json or output_dir / "throughput.json", res)]
    if make_plots:
        rows = res["results"]

        def draw(plt: Any) -> None:
            names = [r["backend"] for r in rows]
            vals = [r["output_tokens_per_s"] for r in rows]
            plt.bar(names, vals, color="tab:blue")
            for i, v in enumerate(vals):
                plt.text(i, v, f"{v:.0f}", ha="center", va="bottom")
            plt.ylabel("output tokens/s")
            w = res["workload"]
            plt.title(f"throughput, {w['kind']} workload, {w['num_requests']} requests")

        p = plot(output_dir / "throughput.png", draw)
        if p:
            paths.append(p)
    return paths
