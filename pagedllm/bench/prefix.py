"""``bench prefix``: time to first token with prefix caching on vs off, on a shared-prefix workload.

One invocation builds two engines from the same kwargs, ``enable_prefix_caching`` True and
False, warms both up, then runs the workload ``reps`` times per engine, interleaved
(``bench.harness``). Each run starts with an empty prefix cache, so hits come only from
within the run (the ``chat`` workload: one shared system prompt, and multi-turn histories).

Requests arrive all at t0 (``request_rate=inf``, the default) or by a seeded Poisson process;
the offline loop (``engine.drive``) adds each request once its arrival time has passed, so TTFT
= the return of the step that made its first token - the moment it was added: queueing
included. Blocks become cacheable only after the step that computed them, so requests
admitted in the same step as the first holder of a prefix miss it: a hit needs staggered
arrivals or a workload larger than one step's token budget (``max_num_batched_tokens``).
Reported per engine:

    ttft_ms              mean / p50 / p90 over every request of every repetition
    computed_prompt_tokens   prompt positions the scheduler sent to the model (prefill tokens,
                         recomputation after preemption included), vs ``prompt_tokens``
    prefix_cache_hit_rate    prompt tokens found cached / prompt tokens looked up
    throughput           requests/s and output tokens/s of the fastest repetition
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path
from typing import Any

from pagedllm.bench.command import add_workload_command_args, show, workload
from pagedllm.bench.harness import interleaved, timing
from pagedllm.bench.report import (
    format_table,
    machine_info,
    percentiles,
    plot,
    write_json,
)
from pagedllm.bench.workload import BenchRequest, WorkloadSpec, submissions, summarize

COLUMNS = ("prefix_caching", "ttft_mean_ms", "ttft_p50_ms", "ttft_p90_ms", "computed_prompt_tokens",
           "prompt_tokens", "prefix_cache_hit_rate", "requests_per_s", "output_tokens_per_s")


COMMAND = "prefix"
HELP = ("time to first token with prefix caching on vs off on a shared-system-prompt (chat) "
        "workload, interleaved")


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reps", type=int, default=3, help="repetitions per setting (TTFT pooled, "
                   "fastest for throughput)")
    p.add_argument("--warmup", type=int, default=4, help="requests in each engine's warm-up run")
    add_workload_command_args(p, 32, arrivals=True)
    p.set_defaults(kind="chat", request_rate=math.inf)


def run(a: argparse.Namespace) -> int:
    kw, spec, reqs, _ = workload(a)
    return show(report_prefix(run_prefix(reqs, spec, kw, a.reps, a.warmup), a.output_dir,
                              a.output_json, a.plot))


class _Engine:
    def __init__(self, engine_kwargs: dict[str, Any], caching: bool) -> None:
        from pagedllm.engine import LLMEngine

        self.caching = caching
        self.engine = LLMEngine.from_args(**{**engine_kwargs, "enable_prefix_caching": caching})

    def run(self, reqs: list[BenchRequest], arrivals: list[float]) -> dict[str, Any]:
        from pagedllm.engine.drive import Clock, drive

        eng = self.engine
        eng.kv.reset_prefix_cache()  # a repetition must not hit the previous one's blocks
        eng.kv.stats.reset()
        preempted_before = eng.num_preemptions
        prefill_tokens = [0]  # prompt positions sent to the model (the steps' records)

        def on_step(outs: list[Any]) -> None:
            prefill_tokens[0] += eng.stats.num_prefill_tokens

        subs = submissions(eng, reqs, arrivals, prefix="p")
        res = drive(eng, subs, Clock(time.monotonic), on_step)
        ids = [r.request_id for r in subs]
        return {
            "elapsed_s": res.elapsed,
            "ttft_s": [res.first_token[i] - res.added[i] for i in ids],
            "outputs": [list(o.outputs[0].token_ids) for o in res.in_order(ids)],
            "computed_prompt_tokens": prefill_tokens[0],
            "hit_rate": eng.kv.stats.hit_rate,
            "num_preemptions": eng.num_preemptions - preempted_before,
        }


def run_prefix(
    reqs: list[BenchRequest],
    spec: WorkloadSpec,
    engine_kwargs: dict[str, Any],
    reps: int = 3,
    warmup: int = 4,
) -> dict[str, Any]:
    """Arrivals: ``spec.arrivals`` (``--request-rate``; inf, the default: all at t0)."""
    engines = [_Engine(engine_kwargs, True), _Engine(engine_kwargs, False)]
    arrivals = spec.arrivals(reqs)
    warm = (lambda e: e.run(reqs[:warmup], [0.0] * min(warmup, len(reqs)))) if warmup else None
    runs = dict(zip((True, False), interleaved(engines, lambda e: e.run(reqs, arrivals), reps, warm)))

    prompt_tokens = sum(r.prompt_len for r in reqs)
    output_tokens = sum(r.max_tokens for r in reqs)
    results = []
    for caching in (True, False):
        rs = runs[caching]
        ttft = percentiles([t * 1e3 for r in rs for t in r["ttft_s"]], (50, 90))
        times = timing([r["elapsed_s"] for r in rs])
        best = times["elapsed_s"]
        computed = [r["computed_prompt_tokens"] for r in rs]
        results.append({
            "prefix_caching": "on" if caching else "off",
            "ttft_mean_ms": ttft["mean"],
            "ttft_p50_ms": ttft["p50"],
            "ttft_p90_ms": ttft["p90"],
            "computed_prompt_tokens": round(statistics.fmean(computed)),
            "computed_prompt_tokens_all": computed,
            "prompt_tokens": prompt_tokens,
            "computed_fraction": statistics.fmean(computed) / prompt_tokens,
            "prefix_cache_hit_rate": statistics.fmean(r["hit_rate"] for r in rs),
            "requests_per_s": len(reqs) / best,
            "output_tokens_per_s": output_tokens / best,
            **times,
            "num_preemptions": [r["num_preemptions"] for r in rs],
        })
    on, off = results
    agree = sum(a == b for a, b in zip(runs[True][0]["outputs"], runs[False][0]["outputs"]))
    return {
        "benchmark": "prefix",
        "results": results,
        "ratios": {
            "ttft_mean_off/on": off["ttft_mean_ms"] / on["ttft_mean_ms"],
            "ttft_p50_off/on": off["ttft_p50_ms"] / on["ttft_p50_ms"],
            "computed_prompt_tokens_on/off": on["computed_prompt_tokens"] / off["computed_prompt_tokens"],
            "requests_per_s_on/off": on["requests_per_s"] / off["requests_per_s"],
        },
        "greedy_output_agreement": agree / len(reqs) if reqs else 1.0,
        "reps": reps,
        "request_rate": spec.request_rate,
        "order": "interleaved: rep r runs the engines rotated by r",
        "workload": {**spec.describe(), **summarize(reqs)},
        "engine": {k: v for k, v in engine_kwargs.items()
                   if v is not None and k != "enable_prefix_caching"},
        "machine": machine_info(),
    }


def report_prefix(res: dict[str, Any], output_dir: Path, output_json: Path | None,
                  make_plots: bool = True) -> list[Path]:
    print(format_table(res["results"], COLUMNS,
                       ["prefix cache", "TTFT mean ms", "TTFT p50 ms", "TTFT p90 ms",
                        "computed prompt tok", "prompt tok", "hit rate", "req/s", "out tok/s"]))
    r = res["ratios"]
    print(f"caching off/on: TTFT mean x{r['ttft_mean_off/on']:.2f}, p50 "
          f"x{r['ttft_p50_off/on']:.2f}; prompt tokens computed on/off "
          f"{r['computed_prompt_tokens_on/off']:.2f}; req/s on/off x{r['requests_per_s_on/off']:.2f}")
    print(f"greedy outputs identical on/off: {res['greedy_output_agreement']:.0%}")
    paths = [write_json(output_json or output_dir / "prefix.json", res)]
    if make_plots:
        rows = res["results"]

        def draw(plt: Any) -> None:
            names = [f"caching {x['prefix_caching']}" for x in rows]
            for k, (key, label) in enumerate((("ttft_p50_ms", "p50"), ("ttft_p90_ms", "p90"))):
                xs = [i + 0.4 * k for i in range(len(rows))]
                plt.bar(xs, [x[key] for x in rows], width=0.4, label=label)
            plt.xticks([i + 0.2 for i in range(len(rows))], names)
            plt.ylabel("time to first token, ms")
            plt.legend()
            w = res["workload"]
            plt.title(f"prefix caching, {w['kind']} workload, {w['num_requests']} requests")

        p = plot(output_dir / "prefix.png", draw)
        if p:
            paths.append(p)
    return paths
