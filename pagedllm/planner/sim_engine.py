"""SimulatedEngine: the engine core on a simulated executor, as ``drive`` runs an engine.

It is an engine for ``pagedllm.engine.drive`` (``step``, ``abort_request``,
``has_unfinished_requests``) whose step is ``EngineCore.step`` on the ``SimulatedExecutor``
(``pagedllm.executor.simulated``) and whose clock is modelled: each step adds the step-cost
model's time for its record (``StepStats``), or 1 without a model (the clock counts steps).
``SimClock`` is that clock for ``drive``: when nothing runs, it jumps to the next arrival.

Requests are workload positions: ``admit(i)`` adds request ``i`` as ``r<i>`` (its n sequences
``r<i>#<k>``). A sequence that generated all its recorded tokens is aborted after the step, as
the front end aborts one whose stop string it found. The engine keeps its own record of every
step and request (``ReplayResult``); ``close`` returns it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from pagedllm.engine.drive import Clock
from pagedllm.engine.messages import EngineCoreOutput, EngineCoreRequest
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.planner.cost import StepCostModel, step_features
from pagedllm.planner.result import ReplayResult
from pagedllm.sampling_params import SamplingParams
from pagedllm.sched import Scheduler, SchedulerOutput
from pagedllm.sched.stats import StepStats

if TYPE_CHECKING:
    from pagedllm.bench.workload import BenchRequest
    from pagedllm.config import EngineConfig


class SimulatedEngine:
    """One engine's replay (module docstring); ``planner.dp`` steps N of them behind a router."""

    def __init__(self, reqs: list[BenchRequest], config: EngineConfig,
                 cost: StepCostModel | None = None, arrivals: list[float] | None = None,
                 scheduler_cls: type[Scheduler] = Scheduler,
                 on_step: Callable[[StepStats, float], None] | None = None) -> None:
        from pagedllm.engine.engine_core import EngineCore  # torch: only when a replay runs
        from pagedllm.executor.simulated import SimulatedExecutor

        n = len(reqs)
        if arrivals is None:
            arrivals = [r.arrival_time or 0.0 for r in reqs]
        if len(arrivals) != n:
            raise ValueError(f"got {len(arrivals)} arrival times for {n} requests")
        _check(reqs, config)
        self.recorded: dict[str, list[int]] = {}  # sequence id -> its recorded tokens
        self.core = EngineCore(config, scheduler_cls, SimulatedExecutor(config, self.recorded.get))
        self.core.on_schedule = self._check_progress
        self.sched = self.core.scheduler
        self.reqs, self.cost, self.on_step = reqs, cost, on_step
        self.arrivals = arrivals if cost is not None else [0.0] * n
        self.seqs: dict[str, int] = {}  # sequence id -> workload position, while it runs
        self.live: dict[str, int] = {}  # sequence id -> output tokens so far, while it runs
        self.left = [0] * n  # per request: its sequences still running
        self.finished: list[int] = []  # workload positions finished by the last step
        plan = self.core.kv_plan
        self.res = ReplayResult(cost is not None, 0, 0, {}, 0, 0.0, plan.num_blocks,
                                plan.block_size, sum(r.prompt_len for r in reqs), 0, 0.0,
                                list(self.arrivals), [math.nan] * n, [math.nan] * n, [0] * n,
                                longest_output=[0] * n)
        self.clock, self.steps = 0.0, 0

    def _check_progress(self, out: SchedulerOutput) -> None:
        if out.is_empty:
            raise RuntimeError(
                f"the scheduler made no progress at step {self.steps + 1} with "
                f"{len(self.sched.requests)} requests queued: the KV pool "
                f"({self.sched.kv.num_blocks} blocks) cannot hold them; raise --kv-cache-memory / "
                "--num-kv-blocks")

    # -- drive's engine ---------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    @property
    def busy(self) -> bool:
        return self.core.has_unfinished_requests()

    def add(self, request_id: str) -> None:
        """``drive``'s submission ``r<i>``: ``admit(i)``."""
        self.admit(int(request_id[1:]))

    def admit(self, i: int) -> None:
        """Request ``i`` arrives (the clock moves to its arrival if the engine sat idle)."""
        r = self.reqs[i]
        self.wait_until(self.arrivals[i])
        rid = f"r{i}"
        lora = None if r.lora_id is None else LoRARequest(f"lora-{r.lora_id}", r.lora_id, "")
        params = SamplingParams(n=r.n, temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
        self.core.add_request(EngineCoreRequest(  # the engine's checks: a prompt it refuses fails
            request_id=rid, prompt_token_ids=list(r.prompt_token_ids), sampling_params=params,
            arrival_time=self.arrivals[i]), lora)
        for k, c in enumerate(self.core.groups[rid]):  # request ids: r<i>, or r<i>#<k> for n > 1
            self.seqs[c.request_id], self.live[c.request_id] = i, 0
            if r.output_token_ids is not None:
                self.recorded[c.request_id] = r.output_token_ids[k]
        self.left[i] = r.n

    def wait_until(self, t: float) -> None:
        """An idle engine's clock moves to ``t`` (the next arrival); a busy one's does not."""
        if not self.busy:
            self.clock = max(self.clock, t)

    def abort_request(self, request_id: str) -> bool:
        """Drop a request (``drive`` does, on an error): it is not counted as finished."""
        return bool(self.core.abort_requests([request_id]))

    def step(self) -> list[RequestOutput]:
        """One step of the engine core and its modelled time. Returns, for ``drive``, an
        output per request that got its first token or finished."""
        outs = self.core.step()
        self.steps += 1
        rec = outs.stats
        assert rec is not None
        self.clock += self.cost.predict(step_features(rec)) if self.cost is not None else 1.0
        self.finished = []
        firsts: list[int] = []
        ended, grew = self._take(outs.outputs, firsts)
        for sid in ended:
            self._end(sid)
        # a sequence that generated all its recorded tokens stops there (as a stop string
        # found by the front end aborts it, before the next step)
        done = [sid for sid in grew if sid in self.live and sid in self.recorded
                and self.live[sid] >= len(self.recorded[sid])]
        if done:
            self.core.abort_requests(done, rec)
            for sid in done:
                self._end(sid)
        self.res.add_step(rec, self.clock)
        if self.on_step is not None:
            self.on_step(rec, self.clock)
        return [_output(i, i in self.finished) for i in {*firsts, *self.finished}]

    def _take(self, outputs: list[EngineCoreOutput], firsts: list[int]) -> tuple[list[str], list[str]]:
        """Record the step's new tokens (``firsts``: requests given their first token); the
        sequences it finished, and those given tokens."""
        res, ended, grew = self.res, [], []
        for o in outputs:
            sid = o.request_id
            if o.error is not None:
                raise RuntimeError(f"request {sid} failed in the replay: {o.error_detail}")
            if o.new_token_ids:
                i = self.seqs[sid]
                self.live[sid] += len(o.new_token_ids)
                grew.append(sid)
                if res.first_token[i] != res.first_token[i]:  # NaN: the request's first token
                    res.first_token[i] = self.clock
                    firsts.append(i)
            if o.finish_reason is not None:
                ended.append(sid)
        return ended, grew

    def _end(self, seq_id: str) -> None:
        """Sequence ``seq_id`` ended; its request with its last sequence."""
        res, k, i = self.res, self.live.pop(seq_id), self.seqs.pop(seq_id)
        self.recorded.pop(seq_id, None)
        res.num_output[i] += k
        res.longest_output[i] = max(res.longest_output[i], k)
        self.left[i] -= 1
        if not self.left[i]:
            res.finished[i] = self.clock
            self.finished.append(i)

    def close(self) -> ReplayResult:
        self.res.close(self.sched, self.steps, self.clock)
        if self.core.spec is not None:
            self.res.spec = self.core.spec.total
        self.core.shutdown()
        return self.res


class SimClock(Clock):
    """``drive``'s clock on a ``SimulatedEngine``: its modelled time; when nothing runs, the
    engine's clock jumps to the next arrival."""

    def __init__(self, engine: SimulatedEngine) -> None:
        self.engine = engine
        super().__init__(lambda: engine.clock, sleeps=False)

    def wait_until(self, t: float) -> None:
        self.engine.wait_until(t)


def _output(i: int, finished: bool) -> RequestOutput:
    """What ``drive`` reads of a step's output for request ``i``: a token came, and whether it
    finished (the tokens themselves are the replay's, in its ``ReplayResult``)."""
    return RequestOutput(f"r{i}", None, [], None, [CompletionOutput(0, "", [0], None, None)],
                         finished)


def _check(reqs: list[BenchRequest], config: EngineConfig) -> None:
    """What the replay cannot run, refused by name."""
    for i, r in enumerate(reqs):
        if r.output_token_ids is not None and len(r.output_token_ids) != r.n:
            raise ValueError(f"request {i}: {len(r.output_token_ids)} recorded outputs for "
                             f"n={r.n} sequences")
    spec = config.speculative
    if spec is not None and spec.method == "draft_model":
        raise ValueError("the planner replays n-gram speculation only: a draft model's "
                         "proposals need the draft model run (measure with pagedllm bench "
                         "throughput)")
    if config.lora is None and any(r.lora_id is not None for r in reqs):
        raise ValueError("requests that run LoRA adapters need --enable-lora")
