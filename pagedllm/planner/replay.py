"""Replay a workload through the engine's own step, with the model taken out.

The engine core runs as it is (``EngineCore.step``: its scheduler, KV manager, memory policy,
speculative decoding, n > 1 fan-out, LoRA residency), on a simulated executor that runs no model
(``pagedllm.executor.simulated``), driven by the engine's one drive loop; only the clock is the
planner's (``planner/sim_engine.py``, STYLE 17)::

    drive(SimulatedEngine, the workload, SimClock)     the one offline loop (engine/drive.py)
      requests whose arrival time has come -> core.add_request
      outputs = core.step()        schedule -> SimulatedExecutor -> update -> outputs
      clock += step_cost(step_features(outputs.stats))   instead of the forward's time
      a sequence past its recorded tokens -> core.abort_requests     (as a stop string)

The tokens are the workload's: a request's ``output_token_ids`` (a recorded run, one list per
sequence) replay token for token, so speculative decoding accepts what that run accepted and the
replay of a run's own tokens takes its steps, preemptions and peak running exactly
(``tests/planner/test_replay_engine.py``). Without them each sequence gets stand-in tokens
outside the vocabulary, unique per sequence and position: no prompt contains one, no two
sequences share an output block (no false prefix hits), no n-gram proposal matches, and a
sequence recomputed after preemption still finds its own cached blocks, as on the real engine.
Outputs then run to ``max_tokens`` (the benchmarks' ``ignore_eos``).

Without a step-cost model the clock counts steps: scheduling (steps, preemptions, peak running,
KV use, prefix hits) is still exact, every request arrives at once, and no timings are given.
Not replayed: a draft model's proposals (refused: they need the draft model run), beam search
(its rounds are chosen from logprobs) and grammars (a workload carries no sampling parameters).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from pagedllm.engine.drive import Submission, drive
from pagedllm.planner.cost import StepCostModel
from pagedllm.planner.result import ReplayResult, summarize
from pagedllm.planner.sim_engine import SimClock, SimulatedEngine
from pagedllm.sched import Scheduler
from pagedllm.sched.stats import StepStats

if TYPE_CHECKING:
    from pagedllm.bench.workload import BenchRequest
    from pagedllm.config import EngineConfig

__all__ = ["ReplayResult", "replay", "summarize", "quiet_engine"]


def replay(
    reqs: list[BenchRequest],
    config: EngineConfig,
    cost: StepCostModel | None = None,
    arrivals: list[float] | None = None,
    scheduler_cls: type[Scheduler] = Scheduler,
    on_step: Callable[[StepStats, float], None] | None = None,
) -> ReplayResult:
    """Run ``reqs`` through the engine for ``config`` with the model taken out. ``arrivals``
    (seconds from the start, one per request) default to each request's ``arrival_time``, else
    0; they are ignored without a ``cost`` model (the clock then counts steps).
    ``on_step(record, clock)`` sees every step's record and its end time."""
    with quiet_engine():
        eng = SimulatedEngine(reqs, config, cost, arrivals, scheduler_cls, on_step)
        drive(eng, [Submission(f"r{i}", eng.add, at) for i, at in enumerate(eng.arrivals)],
              SimClock(eng))
        return eng.close()


@contextlib.contextmanager
def quiet_engine() -> Iterator[None]:
    """The replayed core's INFO lines (its start-up line, every preemption) off while it runs:
    the planner prints its own summary."""
    log = logging.getLogger("pagedllm")
    before = log.level
    log.setLevel(max(before, logging.WARNING))
    try:
        yield
    finally:
        log.setLevel(before)
