"""Scheduling: which requests run each step, with how many tokens, and what KV moves that needs.

Pure Python (never imports torch), like ``pagedllm.kv`` below it::

    scheduler.py    batching under the token budget, priorities, preemption, forks
    admission.py    the check that a prompt can ever be served
    preemption.py   recompute or swap for one victim, and the cost model behind "auto"
    memory.py       KV memory decisions: elastic grow / shrink, compaction triggers
    stats.py        StepStats: one record per step (kv_stats, metrics, benchmarks read it)
    output.py       SchedulerOutput: the step as the scheduler decided it (live Requests; the
                    executor is told runner/model_input.py's ModelInput, built from it)
"""

from pagedllm.sched.output import ScheduledRequest, SchedulerOutput
from pagedllm.sched.scheduler import Scheduler

__all__ = ["ScheduledRequest", "Scheduler", "SchedulerOutput"]
