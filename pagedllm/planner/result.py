"""What a replay saw (``ReplayResult``) and the planner's summary of it (``summarize``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pagedllm.sched import Scheduler
from pagedllm.sched.memory import kv_utilization
from pagedllm.sched.stats import SpecDecodeCounts, StepStats

MAX_SERIES_POINTS = 200  # KV use over time is kept at about this many points


@dataclass
class ReplayResult:
    """What one replay saw. Per request (workload order): arrival, first token and finish times
    (seconds on the simulated clock; steps without a cost model) and output tokens."""

    timed: bool
    num_steps: int
    num_preemptions: int
    preemptions_by_kind: dict[str, int]
    peak_running: int
    elapsed: float
    num_blocks: int
    block_size: int
    prompt_tokens: int
    output_tokens: int
    prefix_cache_hit_rate: float
    arrival: list[float]
    first_token: list[float]
    finished: list[float]
    num_output: list[int]
    scheduler: Scheduler | None = None  # the replayed scheduler, in its final state
    # per step (its record, right after scheduling): end time, requests holding KV, live
    # tokens, their reserved slots, the pool's used slots
    series_t: list[float] = field(default_factory=list)
    series_running: list[int] = field(default_factory=list)
    series_live: list[int] = field(default_factory=list)
    series_reserved: list[int] = field(default_factory=list)
    series_pool: list[int] = field(default_factory=list)
    lora_page_ins: int = 0  # LoRA adapters paged into the pool (--lora-adapters)
    lora_page_outs: int = 0
    longest_output: list[int] = field(default_factory=list)  # per request: its longest sequence
    spec: SpecDecodeCounts | None = None  # speculative decoding's totals (None: off)

    def add_step(self, rec: StepStats, clock: float) -> None:
        self.series_t.append(clock)
        self.series_running.append(rec.batch_running)
        self.series_live.append(rec.live_tokens)
        self.series_reserved.append(rec.reserved_tokens)
        self.series_pool.append(rec.pool_tokens)

    def close(self, sched: Scheduler, steps: int, clock: float) -> None:
        """The totals, from the scheduler at the end of the replay."""
        self.scheduler = sched
        self.num_steps = steps
        self.num_preemptions = sched.num_preemptions
        self.preemptions_by_kind = dict(sched.preemptions_by_kind)
        self.peak_running = max(self.series_running, default=0)
        self.elapsed = clock
        self.output_tokens = sum(self.num_output)
        self.prefix_cache_hit_rate = sched.kv.stats.hit_rate
        pages = sched.kv.adapters
        self.lora_page_ins, self.lora_page_outs = pages.num_loads, pages.num_evictions

    @property
    def ttft(self) -> list[float]:
        return [f - a for f, a in zip(self.first_token, self.arrival)]

    @property
    def tpot(self) -> list[float]:
        """Seconds per output token after the first, of requests with more than one (n > 1:
        of the longest sequence)."""
        return [t for i in range(len(self.arrival)) if (t := self.request_tpot(i)) is not None]

    def request_tpot(self, i: int) -> float | None:
        n = self.longest_output[i]
        return (self.finished[i] - self.first_token[i]) / (n - 1) if n > 1 else None

    def kv_series(self) -> dict[str, list[float]]:
        """Pool use (used slots / pool) and KV utilization (live tokens / their reserved slots)
        over time, thinned to about ``MAX_SERIES_POINTS`` points."""
        n = len(self.series_t)
        idx = range(0, n, max(1, math.ceil(n / MAX_SERIES_POINTS)))
        slots = self.num_blocks * self.block_size
        return {
            "t": [self.series_t[i] for i in idx],
            "running": [float(self.series_running[i]) for i in idx],
            "pool_usage": [self.series_pool[i] / slots for i in idx],
            "kv_utilization": [kv_utilization(self.series_live[i], self.series_reserved[i])
                               for i in idx],
        }

    def kv_means(self) -> dict[str, float]:
        """Step-averaged and peak pool use; KV utilization over the steps holding KV, weighted
        by their reserved slots (as the benchmarks' ``kv_utilization``)."""
        slots = self.num_blocks * self.block_size
        return {
            "mean_pool_usage": sum(self.series_pool) / (len(self.series_pool) or 1) / slots,
            "peak_pool_usage": max(self.series_pool, default=0) / slots,
            "kv_utilization": kv_utilization(sum(self.series_live), sum(self.series_reserved)),
        }


def summarize(res: ReplayResult) -> dict[str, Any]:
    """The planner's answer for one replay: throughput, latency percentiles, scheduling, KV."""
    from pagedllm.bench.report import percentiles

    out: dict[str, Any] = {
        "num_requests": len(res.arrival),
        "prompt_tokens": res.prompt_tokens,
        "output_tokens": res.output_tokens,
        "num_steps": res.num_steps,
        "num_preemptions": res.num_preemptions,
        "preemptions_by_kind": res.preemptions_by_kind,
        "peak_running": res.peak_running,
        "prefix_cache_hit_rate": res.prefix_cache_hit_rate,
        "num_kv_blocks": res.num_blocks,
        "lora_page_ins": res.lora_page_ins,
        "lora_page_outs": res.lora_page_outs,
        "block_size": res.block_size,
        **res.kv_means(),
    }
    if res.spec is not None:
        out.update({"spec_num_draft_tokens": res.spec.num_draft_tokens,
                    "spec_num_accepted_tokens": res.spec.num_accepted_tokens,
                    "spec_acceptance_rate": res.spec.acceptance_rate})
    if res.timed:
        t = res.elapsed
        ttft, tpot = percentiles(res.ttft), percentiles(res.tpot)
        out.update({
            "elapsed_s": t,
            "output_tokens_per_s": res.output_tokens / t if t else 0.0,
            "requests_per_s": len(res.arrival) / t if t else 0.0,
            **{f"ttft_{k}_s": v for k, v in ttft.items()},
            **{f"tpot_{k}_s": v for k, v in tpot.items()},
        })
    return out
