"""The benchmarks' view of KV memory over a run, read from the engine's per-step records
(``pagedllm.sched.stats.StepStats``), and a model-free scheduler replay.

Per step a ``StepTrace`` keeps, from the record::

    running    requests holding KV (the batch)
    reserved   token slots reserved for them: sum of blocks held * block_size
    live       tokens whose K/V are in the cache once this step has run:
               sum over running requests of num_computed_tokens + new tokens scheduled now,
               less the positions of blocks freed behind a sliding window
    pool       token slots the pool has handed out: (num_blocks - num_free_blocks) * block_size

Utilization = live / reserved (``pagedllm.sched.memory.kv_utilization``, the engine's one
definition); 1 - utilization is the fraction of reserved slots that hold
nothing (internal fragmentation of last blocks, or a max-length reservation's unused tail).
``reserved`` counts a block shared through the prefix cache once per request that holds it, so
utilization never exceeds 1 and is conservative for paging; ``pool`` counts it once (the memory
actually used, lower than ``reserved`` when blocks are shared).

``replay`` drives a scheduler through the planner's model-free replay: scheduling depends on
lengths, not on token values, when outputs run to ``max_tokens`` (``ignore_eos``), so the trace
equals the real engine's, step for step, without torch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pagedllm.bench.workload import BenchRequest
from pagedllm.config import EngineConfig
from pagedllm.sched import Scheduler
from pagedllm.sched.memory import kv_utilization
from pagedllm.sched.stats import StepStats


@dataclass
class StepTrace:
    t: list[float] = field(default_factory=list)  # seconds since the trace was (re)started
    running: list[int] = field(default_factory=list)
    live: list[int] = field(default_factory=list)
    reserved: list[int] = field(default_factory=list)
    pool: list[int] = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)
    num_preemptions: int | None = None  # set by replay (the engine counts its own)

    def add(self, stats: StepStats, t: float | None = None) -> None:
        """One step's record; ``t`` defaults to the seconds since the trace (re)started."""
        self.t.append(time.perf_counter() - self.t0 if t is None else t)
        self.running.append(stats.batch_running)
        self.live.append(stats.live_tokens)
        self.reserved.append(stats.reserved_tokens)
        self.pool.append(stats.pool_tokens)

    def restart(self) -> None:
        self.t.clear()
        self.running.clear()
        self.live.clear()
        self.reserved.clear()
        self.pool.clear()
        self.t0 = time.perf_counter()

    @property
    def utilization(self) -> list[float]:
        return [kv_utilization(lv, rs) for lv, rs in zip(self.live, self.reserved)]

    def summary(self) -> dict[str, Any]:
        """Peak concurrency and time-weighted utilization over the steps that held KV."""
        steps = [i for i, r in enumerate(self.reserved) if r]
        live = sum(self.live[i] for i in steps)
        reserved = sum(self.reserved[i] for i in steps)
        return {
            "steps": len(self.t),
            "peak_running": max(self.running, default=0),
            "mean_running": sum(self.running[i] for i in steps) / len(steps) if steps else 0.0,
            "peak_reserved_tokens": max(self.reserved, default=0),
            "peak_pool_tokens": max(self.pool, default=0),
            "kv_utilization": kv_utilization(live, reserved),
        }


def replay(reqs: list[BenchRequest], scheduler_cls: type[Scheduler],
           config: EngineConfig) -> StepTrace:
    """Run the workload through ``scheduler_cls`` with no model (the planner's replay,
    ``pagedllm.planner.replay``, all requests at once); the step trace (``t`` is the step
    index)."""
    from pagedllm.planner.replay import replay as planner_replay

    trace = StepTrace()
    res = planner_replay(reqs, config, scheduler_cls=scheduler_cls,
                         on_step=lambda rec, _: trace.add(rec, float(len(trace.t))))
    trace.num_preemptions = res.num_preemptions
    return trace
