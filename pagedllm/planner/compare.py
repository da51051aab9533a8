"""``pagedllm plan --compare``: the real engine on the same workload, predicted vs measured.

The real run is the offline loop the replay stands for: each request is added once its arrival
time has passed, the engine steps, and a request's first token and finish are stamped when the
step that made them returns. Throughput is taken from the fastest of ``reps`` runs (on a shared
machine interference only adds time), latencies from that same run; every run's figures are
kept.

The clock is the profile's (``pagedllm plan calibrate --clock``): wall seconds, the loop sleeping
until the next arrival when idle; or this process's CPU seconds, the idle gaps to the next
arrival added on top -- the run as a dedicated core would time it.
"""

from __future__ import annotations

import statistics
import time
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
    from pagedllm.bench.workload import poisson_arrivals
    from pagedllm.engine import LLMEngine

    if threads:
        torch.set_num_threads(threads)
    assert planner.profile is not None
    clock = planner.profile.made_on.get("clock", "wall")
    args = EngineArgs.from_kwargs(engine_kwargs)
    _, predicted = planner.run(args, rate)
    arrivals = ([r.arrival_time or 0.0 for r in reqs] if rate is None
                else poisson_arrivals(len(reqs), rate, planner.seed))
    engine = LLMEngine.from_args(**engine_kwargs)
    _run(engine, reqs[:4], [0.0] * min(4, len(reqs)))  # warm-up
    runs = [_run(engine, reqs, arrivals, clock) for _ in range(max(1, reps))]
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


class _Clock:
    def __init__(self, kind: str) -> None:
        from pagedllm.planner.calibrate import CLOCKS

        self.kind, self.read = kind, CLOCKS[kind]
        self.t0, self.skipped = self.read(), 0.0

    def now(self) -> float:
        return self.read() - self.t0 + self.skipped

    def wait_until(self, t: float) -> None:
        if self.kind == "wall":
            time.sleep(max(0.0, t - self.now()))
        else:
            self.skipped += max(0.0, t - self.now())


def _run(engine: Any, reqs: list[BenchRequest], arrivals: list[float],
         clock_kind: str = "wall") -> dict[str, Any]:
    from pagedllm.sampling_params import SamplingParams

    engine.kv.reset_prefix_cache()  # a run must not hit the previous one's blocks
    steps0, pre0 = engine.scheduler.num_steps, engine.num_preemptions
    peak = 0
    order = sorted(range(len(reqs)), key=lambda i: arrivals[i])
    n = len(reqs)
    arrival, first, done = [0.0] * n, [-1.0] * n, [0.0] * n
    nout = [0] * n
    nxt = 0
    clock = _Clock(clock_kind)
    while nxt < n or engine.has_unfinished_requests():
        now = clock.now()
        while nxt < n and arrivals[order[nxt]] <= now:
            i = order[nxt]
            r = reqs[i]
            engine.add_request(f"c{i}", {"prompt_token_ids": r.prompt_token_ids},
                               SamplingParams(temperature=0.0, max_tokens=r.max_tokens,
                                              ignore_eos=True))
            arrival[i] = arrivals[i]  # the request waited from then, mid-step or not
            nxt += 1
        if not engine.has_unfinished_requests():
            clock.wait_until(arrivals[order[nxt]])
            continue
        outs = engine.step()
        now = clock.now()
        peak = max(peak, engine.stats.batch_running)  # the step's record
        for o in outs:
            i = int(o.request_id[1:])
            if first[i] < 0:
                first[i] = now
            if o.finished:
                done[i] = now
                nout[i] = len(o.outputs[0].token_ids)
    elapsed = clock.now()
    ttft = percentiles([f - a for f, a in zip(first, arrival)])
    tpot = percentiles([(d - f) / (k - 1) for f, d, k in zip(first, done, nout) if k > 1])
    return {
        "elapsed_s": elapsed,
        "output_tokens_per_s": sum(nout) / elapsed,
        "requests_per_s": n / elapsed,
        **{f"ttft_{k}_s": v for k, v in ttft.items()},
        **{f"tpot_{k}_s": v for k, v in tpot.items()},
        "num_steps": engine.scheduler.num_steps - steps0,
        "num_preemptions": engine.num_preemptions - pre0,
        "peak_running": peak,
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
