"""``bench block-size``: the same workload and KV memory at block sizes 1..512.

Per block size: an engine whose pool holds the same number of token slots (``budget_tokens``),
the workload run ``reps`` times interleaved across block sizes. Reported:

- throughput (output tokens/s of the fastest repetition: load only adds time) and peak
  concurrency;
- KV utilization (live / reserved slots) and internal fragmentation (1 - utilization: the
  unused tail of each request's last block);
- table-lookup overhead: time per step in ``ModelRunner.prepare`` (block tables -> slot mapping)
  and in the attention backend (gathering K/V through the block tables), per step and as a
  share of the step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedllm.bench.report import format_table, machine_info, plot, write_json
from pagedllm.bench.workload import BenchRequest, WorkloadSpec, summarize

DEFAULT_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
COLUMNS = ("block_size", "num_blocks", "output_tokens_per_s", "peak_running", "kv_utilization",
           "internal_fragmentation", "prepare_ms_per_step", "attention_ms_per_step",
           "attention_share")


class _Timed:
    """Wraps a bound method; accumulates its wall time (instance attribute shadows the class's)."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.total, self.calls = fn, 0.0, 0

    def __call__(self, *a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return self.fn(*a, **k)
        finally:
            self.total += time.perf_counter() - t
            self.calls += 1


@dataclass
class _Entry:
    block_size: int
    num_blocks: int
    backend: Any
    prep: _Timed
    attn: _Timed
    runs: list[tuple[Any, float, float, int]] = field(default_factory=list)  # result, s, s, steps


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
    entries: list[_Entry] = []
    for bs in sizes:
        nb = budget_tokens // bs
        if nb < -(-mml // bs):
            raise ValueError(f"budget_tokens={budget_tokens} holds {nb} blocks of {bs}, fewer than "
                             f"one max_model_len={mml} request needs; raise --budget-tokens")
        kw = {**engine_kwargs, "block_size": bs, "num_kv_blocks": nb, "kv_cache_memory": None}
        b = EngineBackend(f"bs{bs}", kw, "paged")
        prep = _Timed(b.engine.runner.prepare)
        b.engine.runner.prepare = prep  # type: ignore[method-assign]
        attn = _Timed(b.engine.runner.backend.forward)
        b.engine.runner.backend.forward = attn  # type: ignore[method-assign]
        b.run(reqs[:2])  # warm-up
        entries.append(_Entry(bs, nb, b, prep, attn))
    for rep in range(reps):
        k = rep % len(entries)
        for e in entries[k:] + entries[:k]:
            e.prep.total = e.attn.total = 0.0
            e.prep.calls = 0
            res = e.backend.run(reqs)
            e.runs.append((res, e.prep.total, e.attn.total, e.prep.calls))

    rows = []
    for e in entries:
        res, prep_s, attn_s, steps = min(e.runs, key=lambda r: r[0].elapsed_s)  # least disturbed
        util = res.stats["kv_utilization"]
        rows.append({
            "block_size": e.block_size,
            "num_blocks": e.num_blocks,
            "output_tokens_per_s": res.output_tokens / res.elapsed_s,
            "total_tokens_per_s": (res.prompt_tokens + res.output_tokens) / res.elapsed_s,
            "elapsed_s": res.elapsed_s,
            "elapsed_s_all": [r[0].elapsed_s for r in e.runs],
            "steps": steps,
            "peak_running": res.stats["peak_running"],
            "mean_running": res.stats["mean_running"],
            "kv_utilization": util,
            "internal_fragmentation": 1.0 - util,
            "prepare_ms_per_step": 1e3 * prep_s / max(steps, 1),
            "attention_ms_per_step": 1e3 * attn_s / max(steps, 1),
            "attention_share": attn_s / res.elapsed_s,
            "num_preemptions": res.stats["num_preemptions"],
        })
    best = max(rows, key=lambda r: r["output_tokens_per_s"])
    return {
        "benchmark": "block-size",
        "budget_tokens": budget_tokens,
        "reps": reps,
        "results": rows,
        "best_block_size": best["block_size"],
        "best_output_tokens_per_s": best["output_tokens_per_s"],
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
