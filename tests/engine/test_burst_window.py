"""The engine-core loop's burst window (``CoreLoop``, ``--burst-gap-ms``): after an idle spell,
requests that follow each other within the gap join the first step; a busy core never waits.
A scripted transport (each ``recv`` takes the next item, whatever its timeout, and records the
timeout asked) and a stub core make it deterministic."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from pagedllm.engine.core_proc import BURST_MAX_S, CoreLoop
from pagedllm.engine.messages import Accepted, EngineCoreOutputs, EngineCoreRequest, Shutdown
from pagedllm.sampling_params import SamplingParams

GAP = 0.002


def _req(rid: str) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=[1, 2], sampling_params=SamplingParams(),
                             arrival_time=0.0)


class Script:
    def __init__(self, items: list[Any]) -> None:
        self.items, self.asked, self.sent = list(items), [], []

    def recv(self, timeout_s: float | None) -> Any:
        self.asked.append(timeout_s)
        return self.items.pop(0) if self.items else Shutdown()

    def send(self, msg: Any) -> None:
        self.sent.append(msg)


class StubCore:
    """Each added request needs two steps; ``steps`` records the requests each step saw."""

    def __init__(self) -> None:
        self.left: dict[str, int] = {}
        self.steps: list[list[str]] = []
        sched = SimpleNamespace(num_running=0, num_waiting=0)
        self.core = SimpleNamespace(scheduler=sched,
                                    config=SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=8)))

    def has_work(self) -> bool:
        return bool(self.left)

    def add(self, msg: EngineCoreRequest) -> Accepted:
        self.left[msg.request_id] = 2
        self.core.scheduler.num_waiting = len(self.left)
        return Accepted(msg.request_id)

    def step(self) -> EngineCoreOutputs:
        self.steps.append(sorted(self.left))
        self.left = {r: n - 1 for r, n in self.left.items() if n > 1}
        self.core.scheduler.num_waiting = len(self.left)
        return EngineCoreOutputs()

    def fail_all(self, error: str, detail: str) -> EngineCoreOutputs:
        return EngineCoreOutputs()


def _run(items: list[Any], gap: float) -> tuple[StubCore, Script]:
    core, script = StubCore(), Script(items)
    CoreLoop(core, script, burst_gap_s=gap).run()  # type: ignore[arg-type]
    return core, script


def test_a_burst_after_idle_lands_in_one_step_and_a_busy_core_never_waits() -> None:
    # idle: a, nothing queued, then b and c each within the gap, then the gap passes
    core, script = _run([_req("a"), None, _req("b"), _req("c"), None, _req("d"), *[None] * 4],
                        GAP)
    assert core.steps[0] == ["a", "b", "c"]
    assert script.asked[2:5] == [GAP, GAP, GAP]  # the window waited one gap at a time
    # after the first step the core is busy: d is taken with recv(0), no window, next step
    assert script.asked[5] == 0 and core.steps[1] == ["a", "b", "c", "d"]
    assert core.steps[2:] == [["d"]] and script.asked[5:8] == [0, 0, 0]  # (then idle again)


def test_no_gap_steps_at_the_first_arrival() -> None:
    core, script = _run([_req("a"), None, _req("b"), *[None] * 4], 0.0)
    assert core.steps[0] == ["a"] and core.steps[1] == ["a", "b"]
    assert 0 < BURST_MAX_S <= 0.05


def test_step_threads_give_big_steps_every_core() -> None:
    from pagedllm.engine.step_threads import StepThreads

    calls: list[int] = []
    t = StepThreads(1, 2, threshold=256, set_threads=calls.append)
    step = SimpleNamespace(num_batched_tokens=2048)
    t.apply(step)  # type: ignore[arg-type]
    t.apply(step)  # type: ignore[arg-type]
    step.num_batched_tokens = 64
    t.apply(step)  # type: ignore[arg-type]
    assert calls == [2, 1]  # set only when it changes
