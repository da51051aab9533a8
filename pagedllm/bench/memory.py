"""``bench memory``: paged vs contiguous reservation at the same KV budget (same blocks).

Both policies serve the same workload, all requests submitted at once, from a pool of the same
number of blocks. Per step we record running requests, reserved token slots and live tokens
(see ``probe``); reported: peak and mean concurrency, time-weighted KV utilization
(live / reserved), and utilization over time (plotted).

``mode="real"`` runs the real engines (x axis: seconds); ``mode="replay"`` replays the
schedulers with a fake runner (x axis: steps; same scheduling, no model, milliseconds).

On a sliding-window model a third policy runs: ``paged, all blocks`` is the paged engine with
``free_window_blocks=False`` (every block kept, as if the model attended in full), against
``paged``, which frees the blocks that leave the window; the contiguous baseline keeps every block.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pagedllm.bench.command import add_workload_command_args, show, workload
from pagedllm.bench.report import format_table, machine_info, plot, write_json
from pagedllm.bench.workload import BenchRequest, WorkloadSpec, summarize

KEEP = "paged, all blocks"  # the paged engine with free_window_blocks=False
COLUMNS = ("policy", "peak_running", "mean_running", "kv_utilization", "steps", "elapsed_s",
           "num_preemptions")

COMMAND = "memory"
HELP = "paged vs contiguous at the same KV budget: concurrency and KV utilization over time"


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=["real", "replay"], default="real",
                   help="real engines (default) or a model-free scheduler replay")
    p.add_argument("--full-requests", type=int, default=8,
                   help="without --num-kv-blocks: size the pool for this many max_model_len requests")
    add_workload_command_args(p, 64)


def run(a: argparse.Namespace) -> int:
    kw, spec, reqs, cfg = workload(a)
    nb = a.num_kv_blocks or default_num_blocks(cfg.scheduler.max_model_len, cfg.cache.block_size,
                                               a.full_requests)
    return show(report_memory(run_memory(reqs, spec, kw, nb, a.mode), a.output_dir,
                              a.output_json, a.plot))


def default_num_blocks(max_model_len: int, block_size: int, full_requests: int = 8) -> int:
    """A pool holding ``full_requests`` max-length reservations: memory is the bottleneck."""
    return full_requests * -(-max_model_len // block_size)


def run_memory(
    reqs: list[BenchRequest],
    spec: WorkloadSpec,
    engine_kwargs: dict[str, Any],
    num_blocks: int,
    mode: str = "real",
) -> dict[str, Any]:
    from pagedllm.bench.contiguous import ContiguousScheduler
    from pagedllm.bench.workload import engine_config
    from pagedllm.sched import Scheduler

    kwargs = {**engine_kwargs, "num_kv_blocks": num_blocks, "kv_cache_memory": None}
    keep = {**kwargs, "free_window_blocks": False}
    base = engine_config(kwargs)
    windowed = base.cache.kv_window(base.model) is not None
    policies = {"paged": (Scheduler, kwargs)}
    if windowed:
        policies[KEEP] = (Scheduler, keep)
    policies["contiguous"] = (ContiguousScheduler, keep)
    rows, series = [], {}
    for name, (cls, kw) in policies.items():
        if mode == "replay":
            from pagedllm.bench.probe import replay

            trace = replay(reqs, cls, engine_config(kw))
            elapsed, preemptions = None, trace.num_preemptions
        elif mode == "real":
            from pagedllm.bench.baselines import EngineBackend

            backend = EngineBackend(name, kw, "contiguous" if name == "contiguous" else "paged")
            res = backend.run(reqs)
            trace = backend.trace
            elapsed, preemptions = res.elapsed_s, res.stats["num_preemptions"]
        else:
            raise ValueError(f"mode must be 'real' or 'replay', got {mode!r}")
        rows.append({"policy": name, **trace.summary(), "elapsed_s": elapsed,
                     "num_preemptions": preemptions})
        series[name] = {"t": trace.t, "running": trace.running, "live": trace.live,
                        "reserved": trace.reserved, "pool": trace.pool,
                        "utilization": trace.utilization}
    by = {r["policy"]: r for r in rows}
    p, c = by["paged"], by["contiguous"]
    window_ratio = {}
    if windowed:
        k = by[KEEP]
        window_ratio = {"window_peak_running": p["peak_running"] / max(k["peak_running"], 1),
                        "window_mean_running": p["mean_running"] / max(k["mean_running"], 1e-9)}
    return {
        "benchmark": "memory",
        "mode": mode,
        "time_axis": "seconds" if mode == "real" else "steps",
        "num_kv_blocks": num_blocks,
        "block_size": kwargs.get("block_size", 16),
        "budget_tokens": num_blocks * kwargs.get("block_size", 16),
        "results": rows,
        "ratios": {
            "peak_running": p["peak_running"] / max(c["peak_running"], 1),
            "mean_running": p["mean_running"] / max(c["mean_running"], 1e-9),
            "kv_utilization": p["kv_utilization"] / max(c["kv_utilization"], 1e-9),
            **window_ratio,
        },
        "series": series,
        "workload": {**spec.describe(), **summarize(reqs)},
        "engine": {k: v for k, v in kwargs.items() if v is not None},
        "machine": machine_info(),
    }


def report_memory(res: dict[str, Any], output_dir: Path, output_json: Path | None,
                  make_plots: bool = True) -> list[Path]:
    print(f"KV budget: {res['num_kv_blocks']} blocks x {res['block_size']} tokens = "
          f"{res['budget_tokens']} token slots ({res['mode']} run)")
    print(format_table(res["results"], COLUMNS,
                       ["policy", "peak running", "mean running", "KV util", "steps", "time s",
                        "preempted"]))
    r = res["ratios"]
    print(f"paged/contiguous: peak concurrency x{r['peak_running']:.2f}, mean concurrency "
          f"x{r['mean_running']:.2f}, KV utilization x{r['kv_utilization']:.2f}")
    if "window_peak_running" in r:
        print(f"sliding window, freed/kept: peak concurrency x{r['window_peak_running']:.2f}, "
              f"mean concurrency x{r['window_mean_running']:.2f}")
    paths = [write_json(output_json or output_dir / "memory.json", res)]
    if make_plots:
        def draw(plt: Any) -> None:
            fig, (a1, a2) = plt.subplots(2, 1, sharex=False, figsize=(7, 6))
            for name, s in res["series"].items():
                a1.plot(s["t"], [u * 100 for u in s["utilization"]], label=name)
                a2.plot(s["t"], s["running"], label=name)
            a1.set_ylabel("KV utilization %")
            a1.set_ylim(0, 105)
            a1.legend()
            a1.set_title(f"same KV budget: {res['budget_tokens']} token slots")
            a2.set_ylabel("running requests")
            a2.set_xlabel(res["time_axis"])
            a2.legend()

        p = plot(output_dir / "memory.png", draw)
        if p:
            paths.append(p)
    return paths
