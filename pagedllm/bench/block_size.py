"""``bench block-size``: the same workload and KV memory at block sizes 1..512.

Per block size: an engine whose pool holds the same number of token slots (``budget_tokens``),
the workload run ``reps`` times interleaved across block sizes. Reported:

- throughput (output tokens/s of the fastest repetition: load only adds time) and peak
  concurrency;
- KV utilization (live / reserved slots) and internal fragmentation (1 - utilization: the
  unused tail of each request's last block);
- table-lookup overhead: time per step in ``ModelRunner.prepare`` (block tables -> slot mapping,
  from the engine's step records) and in the attention backend (gathering K/V through the
  block tables; a registered backend that clocks the chosen one, ``timed_backend``), per step
  and as a share of the step.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedllm.bench.command import add_workload_command_args, int_list, show, workload
from pagedllm.bench.harness import interleaved, timing
from pagedllm.bench.report import format_table, machine_info, plot, write_json
from pagedllm.bench.workload import BenchRequest, WorkloadSpec, summarize

DEFAULT_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
COLUMNS = ("block_size", "num_blocks", "output_tokens_per_s", "peak_running", "kv_utilization",
           "internal_fragmentation", "prepare_ms_per_step", "attention_ms_per_step",
           "attention_share")

COMMAND = "block-size"
HELP = "sweep KV block sizes at a fixed KV memory"


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--block-sizes", type=int_list, default=DEFAULT_SIZES)
    p.add_argument("--budget-tokens", type=int, default=None,
                   help="KV token slots for every block size (default: 16 x max_model_len)")
    p.add_argument("--reps", type=int, default=2, help="repetitions (the fastest is reported)")
    add_workload_command_args(p, 32)


def run(a: argparse.Namespace) -> int:
    kw, spec, reqs, cfg = workload(a)
    budget = a.budget_tokens or 16 * cfg.scheduler.max_model_len
    res = run_block_size(reqs, spec, kw, budget, tuple(a.block_sizes), a.reps)
    return show(report_block_size(res, a.output_dir, a.output_json, a.plot))


def timed_backend(name: str | None, device: str) -> str:
    """Register (once) an attention backend that is ``name``'s (None: the device's default)
    plus a clock around attending (``attend`` where the backend has one: the fused decoder
    layer calls it directly, and ``forward`` through it; otherwise ``forward``); returns its
    registered name. The engine's instance (``engine.runner.backend``) then holds the seconds
    spent in attention in ``total_s``."""
    from pagedllm.attention.registry import available_backends, get_backend, register_backend

    base = type(get_backend(name, device))
    timed_name = f"timed-{base.name}"
    if timed_name in available_backends():
        return timed_name

    timed = "attend" if hasattr(base, "attend") else "forward"

    class Timed(base):  # type: ignore[valid-type, misc]
        total_s = 0.0

        def _timed(self, *args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return getattr(super(), timed)(*args, **kwargs)
            finally:
                self.total_s += time.perf_counter() - t

    setattr(Timed, timed, Timed._timed)

    Timed.name = timed_name
    Timed.__name__ = Timed.__qualname__ = f"Timed{base.__name__}"
    register_backend(timed_name, Timed)
    return timed_name


@dataclass
class _Run:
    result: Any
    prepare_s: float
    attention_s: float
    steps: int


def run_block_size(
    reqs: list[BenchRequest],
    spec: WorkloadSpec,
    engine_kwargs: dict[str, Any],
    budget_tokens: int,
    sizes: tuple[int, ...] = DEFAULT_SIZES,
    reps: int = 2,
) -> dict[str, Any]:
    from pagedllm.bench.baselines import EngineBackend

    mml = spec.max_model_len
    attention = timed_backend(engine_kwargs.get("attention_backend"),
                              str(engine_kwargs.get("device") or "cpu"))
    backends = []
    for bs in sizes:
        nb = budget_tokens // bs
        if nb < -(-mml // bs):
            raise ValueError(f"budget_tokens={budget_tokens} holds {nb} blocks of {bs}, fewer than "
                             f"one max_model_len={mml} request needs; raise --budget-tokens")
        kw = {**engine_kwargs, "block_size": bs, "num_kv_blocks": nb, "kv_cache_memory": None,
              "attention_backend": attention}
        backends.append(EngineBackend(f"bs{bs}", kw, "paged"))

    def run(b: EngineBackend) -> _Run:
        backend = b.engine.runner.backend
        backend.total_s = 0.0  # type: ignore[attr-defined]
        res = b.run(reqs)
        return _Run(res, sum(b.step_prepare_s), backend.total_s,  # type: ignore[attr-defined]
                    len(b.trace.t))

    runs = interleaved(backends, run, reps, warmup=lambda b: b.run(reqs[:2]))
    rows = []
    for bs, b, rs in zip(sizes, backends, runs):
        best = min(rs, key=lambda r: r.result.elapsed_s)  # least disturbed (bench.harness)
        res, steps = best.result, best.steps
        util = res.stats["kv_utilization"]
        rows.append({
            "block_size": bs,
            "num_blocks": b.engine.kv.num_blocks,
            "output_tokens_per_s": res.output_tokens / res.elapsed_s,
            "total_tokens_per_s": (res.prompt_tokens + res.output_tokens) / res.elapsed_s,
            **timing([r.result.elapsed_s for r in rs]),
            "steps": steps,
            "peak_running": res.stats["peak_running"],
            "mean_running": res.stats["mean_running"],
            "kv_utilization": util,
            "internal_fragmentation": 1.0 - util,
            "prepare_ms_per_step": 1e3 * best.prepare_s / max(steps, 1),
            "attention_ms_per_step": 1e3 * best.attention_s / max(steps, 1),
            "attention_share": best.attention_s / res.elapsed_s,
            "num_preemptions": res.stats["num_preemptions"],
        })
    best_row = max(rows, key=lambda r: r["output_tokens_per_s"])
    return {
        "benchmark": "block-size",
        "budget_tokens": budget_tokens,
        "reps": reps,
        "results": rows,
        "best_block_size": best_row["block_size"],
        "best_output_tokens_per_s": best_row["output_tokens_per_s"],
        "workload": {**spec.describe(), **summarize(reqs)},
        "engine": {k: v for k, v in engine_kwargs.items() if v is not None},
        "machine": machine_info(),
    }


def report_block_size(res: dict[str, Any], output_dir: Path, output_json: Path | None,
                      make_plots: bool = True) -> list[Path]:
    print(f"same KV memory for every block size: {res['budget_tokens']} token slots")
    print(format_table(res["results"], COLUMNS,
                       ["block", "blocks", "out tok/s", "peak run", "KV util", "int frag",
                        "prepare ms/step", "attn ms/step", "attn share"]))
    print(f"fastest on this machine: block size {res['best_block_size']} "
          f"({res['best_output_tokens_per_s']:.1f} output tokens/s)")
    paths = [write_json(output_json or output_dir / "block_size.json", res)]
    if make_plots:
        rows = res["results"]

        def draw(plt: Any) -> None:
            fig, a1 = plt.subplots(figsize=(7, 4.2))
            xs = [r["block_size"] for r in rows]
            a1.plot(xs, [r["output_tokens_per_s"] for r in rows], "o-", color="tab:blue")
            a1.set_xscale("log", base=2)
            a1.set_xlabel("block size (tokens)")
            a1.set_ylabel("output tokens/s", color="tab:blue")
            a2 = a1.twinx()
            a2.plot(xs, [100 * r["kv_utilization"] for r in rows], "s--", color="tab:orange")
            a2.set_ylabel("KV utilization %", color="tab:orange")
            a2.set_ylim(0, 105)
            a1.set_title(f"block-size sweep, {res['budget_tokens']} KV token slots")

        p = plot(output_dir / "block_size.png", draw)
        if p:
            paths.append(p)
    return paths
