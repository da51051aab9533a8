"""``pagedllm plan --compare``: the real engine on the same workload, predicted vs measured.

The real run is the offline loop the replay stands for (``engine.drive``): each request is added
once its arrival time has passed, the engine steps, and a request's first token and finish are
stamped when the step that made them returns. Throughput is taken from the fastest of ``reps`` runs (on a shared
machine interference only adds time), latencies from that same run; every run's figures are
kept.

The clock is the profile's (``pagedllm plan calibrate --clock``): wall seconds, the loop sleeping
until the next arrival when idle; or this process's CPU seconds, the idle gaps to the next
arrival added on top -- the run as a dedicated core would time it.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from pagedllm.bench.report import format_table, percentiles

if TYPE_CHECKING:
    from pagedllm.bench.workload import BenchRequest
    from pagedllm.planner.plan import Planner

METRICS = ("output_tokens_per_s", "requests_per_s", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s",
           "tpot_mean_s", "tpot_p50_s", "elapsed_s", "num_steps", "num_preemptions",
           "peak_running")


def compare(reqs: list[BenchRequest], engine_kwargs: dict[str, Any], planner: Planner,
            rate: float | None, reps: int = 1, threads: int | None = None) -> dict[str, Any]:
    """Replay and real runs of ``reqs``; rows of predicted vs measured per metric."""
    import torch

    from pagedllm.args import EngineArgs
    from pagedllm.bench.workload import arrivals
    from pagedllm.engine import LLMEngine

    if threads:
        torch.set_num_threads(threads)
    assert planner.profile is not None
    clock = planner.profile.made_on.get("clock", "wall")
    args = EngineArgs.from_kwargs(engine_kwargs)
    _, predicted = planner.run(args, rate)
    at = arrivals(reqs, rate, planner.seed)
    engine = LLMEngine.from_args(**engine_kwargs)
    _run(engine, reqs[:4], [0.0] * min(4, len(reqs)))  # warm-up
    runs = [_run(engine, reqs, at, clock) for _ in range(max(1, reps))]
    engine.shutdown()
    best = min(runs, key=lambda r: r["elapsed_s"])
    rows = []
    for k in METRICS:
        p, m = predicted.get(k), best.get(k)
        err = (p - m) / m if isinstance(p, (int, float)) and m else None
        rows.append({"metric": k, "predicted": p, "measured": m, "error": err})
    return {"rows": rows, "runs": runs, "threads": torch.get_num_threads(), "clock": clock,
            "elapsed_s_spread": (max(r["elapsed_s"] for r in runs) - best["elapsed_s"])
            / best["elapsed_s"]}


def _run(engine: Any, reqs: list[BenchRequest], arrivals: list[float],
         clock_kind: str = "wall") -> dict[str, Any]:
    from pagedllm.bench.workload import submissions
    from pagedllm.engine.drive import Clock, drive
    from pagedllm.planner.calibrate import CLOCKS

    engine.kv.reset_prefix_cache()  # a run must not hit the previous one's blocks
    steps0, pre0 = engine.scheduler.num_steps, engine.num_preemptions
    peak = [0]

    def on_step(outs: list[Any]) -> None:
        peak[0] = max(peak[0], engine.stats.batch_running)  # the step's record

    subs = submissions(engine, reqs, arrivals, prefix="c")
    res = drive(engine, subs, Clock(CLOCKS[clock_kind], sleeps=clock_kind == "wall"), on_step)
    ids = [s.request_id for s in subs]
    n, elapsed = len(reqs), res.elapsed
    nout = [len(o.outputs[0].token_ids) for o in res.in_order(ids)]
    first = [res.first_token[i] for i in ids]
    # a request waited from its arrival, mid-step or not
    ttft = percentiles([f - a for f, a in zip(first, arrivals)])
    tpot = percentiles([(res.finished[i] - f) / (k - 1) for i, f, k in zip(ids, first, nout)
                        if k > 1])
    return {
        "elapsed_s": elapsed,
        "output_tokens_per_s": sum(nout) / elapsed,
        "requests_per_s": n / elapsed,
        **{f"ttft_{k}_s": v for k, v in ttft.items()},
        **{f"tpot_{k}_s": v for k, v in tpot.items()},
        "num_steps": engine.scheduler.num_steps - steps0,
        "num_preemptions": engine.num_preemptions - pre0,
        "peak_running": peak[0],
    }


def report_compare(res: dict[str, Any]) -> None:
    rows = [{**r, "error": None if r["error"] is None else f"{r['error']:+.1%}"}
            for r in res["rows"]]
    print(f"predicted vs measured (real engine, {len(res['runs'])} run(s), fastest kept; "
          f"spread of elapsed over runs {res['elapsed_s_spread']:.1%}; "
          f"torch threads {res['threads']}, {res['clock']} clock)")
    print(format_table(rows, ("metric", "predicted", "measured", "error")))
    if len(res["runs"]) > 1:
        tps = [r["output_tokens_per_s"] for r in res["runs"]]
        print(f"measured output tok/s per run: {', '.join(f'{t:.1f}' for t in tps)} "
              f"(median {statistics.median(tps):.1f})")
