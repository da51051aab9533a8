"""Replay a workload through the engine's own scheduler and KV manager, with no model.

The loop is the engine's step with the model taken out (STYLE 17)::

    requests whose arrival time has come -> scheduler.add_request      (as the offline loop)
    out = scheduler.schedule()                                          the engine's Scheduler,
    record = StepStats.open(scheduler, out)   the engine's step record   KVCacheManager, pool
    clock += step_cost(step_features(record))   instead of the forward   (sched/build.py)
    scheduler.update(out, stand-in tokens)
    scheduler.end_step()                      compaction / shrink, as the engine's step

Scheduling depends on lengths, not on token values, when outputs run to ``max_tokens`` (the
trace's ``max_tokens`` is taken as the number of tokens the request generates, as the benchmarks'
``ignore_eos``), except through prefix caching, which hashes every full block, outputs included.
So each request's stand-in output token is its own id outside the vocabulary (request i emits
``-(i + 1)``): no prompt can contain it, and no two requests share an output block, while a
request recomputed after preemption still finds its own cached blocks, as on the real engine.

Without a step-cost model the clock counts steps: scheduling (steps, preemptions, peak running,
KV use, prefix hits) is still exact, every request arrives at once, and no timings are given.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedllm.kv.plan import KVPoolPlan, plan_kv_pool
from pagedllm.lora.request import LoRARequest
from pagedllm.planner.cost import StepCostModel, step_features
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams
from pagedllm.sched import Scheduler
from pagedllm.sched.build import build_scheduler
from pagedllm.sched.memory import kv_utilization
from pagedllm.sched.stats import StepStats

if TYPE_CHECKING:
    from pagedllm.bench.workload import BenchRequest
    from pagedllm.config import EngineConfig

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
        """Seconds per output token after the first, of requests with more than one."""
        return [(e - f) / (n - 1) for f, e, n in zip(self.first_token, self.finished,
                                                     self.num_output) if n > 1]

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


class Replayer:
    """One engine's replay, advanced by the caller: ``admit`` a request of ``reqs`` at its
    arrival, ``advance`` one step (the engine's step with the model taken out: module docstring),
    ``close`` for the result. ``replay`` drives one; ``planner.dp`` drives N behind a router."""

    def __init__(self, reqs: list[BenchRequest], config: EngineConfig,
                 cost: StepCostModel | None = None, arrivals: list[float] | None = None,
                 scheduler_cls: type[Scheduler] = Scheduler, plan: KVPoolPlan | None = None,
                 on_step: Callable[[StepStats, float], None] | None = None) -> None:
        plan = plan or plan_kv_pool(config.model, config.cache, config.scheduler,
                                   lora=config.lora)
        self.sched = build_scheduler(config, plan, scheduler_cls)
        n = len(reqs)
        if arrivals is None:
            arrivals = [r.arrival_time or 0.0 for r in reqs]
        if len(arrivals) != n:
            raise ValueError(f"got {len(arrivals)} arrival times for {n} requests")
        self.reqs, self.cost, self.on_step = reqs, cost, on_step
        self.arrivals = arrivals if cost is not None else [0.0] * n
        self.max_len = config.scheduler.max_model_len
        self.index: dict[str, int] = {}  # request id -> workload position, while it runs
        self.finished: list[int] = []  # workload positions finished by the last step
        self.res = ReplayResult(cost is not None, 0, 0, {}, 0, 0.0, plan.num_blocks,
                                plan.block_size, sum(r.prompt_len for r in reqs), 0, 0.0,
                                list(self.arrivals), [math.nan] * n, [math.nan] * n, [0] * n)
        self.clock, self.steps = 0.0, 0
        for lid in {r.lora_id for r in reqs if r.lora_id is not None}:  # pages as the plan says
            if config.lora is None:
                raise ValueError("requests that run LoRA adapters need --enable-lora")
            self.sched.kv.adapters.register(lid, plan.lora_blocks_per_adapter)

    @property
    def busy(self) -> bool:
        return bool(self.sched.requests)

    def admit(self, i: int) -> None:
        """Request ``i`` arrives (the clock moves to its arrival if the engine sat idle)."""
        r = self.reqs[i]
        if not self.busy:
            self.clock = max(self.clock, self.arrivals[i])
        rid = f"r{i}"
        lora = None if r.lora_id is None else LoRARequest(f"lora-{r.lora_id}", r.lora_id, "")
        self.sched.add_request(Request(  # check_fits: a prompt the engine refuses fails here too
            rid, list(r.prompt_token_ids), SamplingParams(max_tokens=r.max_tokens, ignore_eos=True),
            max_model_len=self.max_len, arrival_time=self.arrivals[i], lora_request=lora))
        self.index[rid] = i

    def advance(self) -> None:
        """One scheduler step and its modelled time (not the engine's ``step``: no model)."""
        sched, res = self.sched, self.res
        out = sched.schedule()
        self.steps += 1
        if out.is_empty:
            raise RuntimeError(
                f"the scheduler made no progress at step {self.steps} with "
                f"{len(sched.requests)} requests queued: the KV pool ({sched.kv.num_blocks} "
                f"blocks) cannot hold them; raise --kv-cache-memory / --num-kv-blocks")
        rec = StepStats.open(sched, out)
        self.clock += self.cost.predict(step_features(rec)) if self.cost is not None else 1.0
        sampled = {s.request.request_id: -1 - self.index[s.request.request_id]
                   for s in out.scheduled if s.samples}
        finished = sched.update(out, sampled)
        sched.end_step()  # memory upkeep (its KV moves cost no modelled time)
        for rid in sampled:
            i = self.index[rid]
            if res.first_token[i] != res.first_token[i]:  # NaN: the request's first token
                res.first_token[i] = self.clock
        self.finished = []
        for req in finished:
            i = self.index.pop(req.request_id)
            res.finished[i] = self.clock
            res.num_output[i] = req.num_output_tokens
            self.finished.append(i)
        res.add_step(rec, self.clock)
        if self.on_step is not None:
            self.on_step(rec, self.clock)

    def close(self) -> ReplayResult:
        self.res.close(self.sched, self.steps, self.clock)
        return self.res


def replay(
    reqs: list[BenchRequest],
    config: EngineConfig,
    cost: StepCostModel | None = None,
    arrivals: list[float] | None = None,
    scheduler_cls: type[Scheduler] = Scheduler,
    plan: KVPoolPlan | None = None,
    on_step: Callable[[StepStats, float], None] | None = None,
) -> ReplayResult:
    """Run ``reqs`` through the engine's scheduler for ``config``. ``arrivals`` (seconds from the
    start, one per request) default to each request's ``arrival_time``, else 0; they are ignored
    without a ``cost`` model (the clock then counts steps). ``on_step(record, clock)`` sees every
    step's record and its end time."""
    r = Replayer(reqs, config, cost, arrivals, scheduler_cls, plan, on_step)
    order = sorted(range(len(reqs)), key=lambda i: r.arrivals[i])
    nxt = 0
    while nxt < len(order) or r.busy:
        while nxt < len(order) and (r.arrivals[order[nxt]] <= r.clock or not r.busy):
            r.admit(order[nxt])
            nxt += 1
        r.advance()
    return r.close()


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
