"""One engine drive loop (``pagedllm.engine.drive``): the structure that pins it, and what it does.

Structure (AST): every ``x.step()`` in the package is in a known place, and only two of those
places call it in a loop:

- ``engine/drive.py: drive``, the offline loop over a workload that ``LLM``, ``pagedllm
  generate``, ``preheat``, every benchmark and the planner's compare and calibration use;
- ``engine/core_proc.py: CoreLoop.run``, the engine core's busy loop. It is a different thing:
  it serves clients (the server, ``AsyncLLM``) that add and abort requests while it runs, it has
  no workload to finish and never ends on its own, and it sends each step's raw core outputs
  to the front end instead of collecting request outputs.

The single calls: ``LLMEngine.step`` (the front end's step wraps the core's), ``CoreService.step``
(one step as a message handler of the core process), and ``planner/calibrate.py _Runner._step``
(times one step of a batch composition the calibration grid built; it decides every step's
contents, so it is not a drive over a workload). The planner's replay is ``drive`` over a
``SimulatedEngine``, whose ``step`` is the core's step on a simulated executor; the
data-parallel plan (``planner/dp.py``) steps N of them, each on its own clock, behind a router,
which one drive over one engine cannot do.
"""

from __future__ import annotations

import ast
import itertools
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pagedllm.engine.drive import Clock, Submission, drive

PKG = Path(__file__).resolve().parents[1] / "pagedllm"
IN_A_LOOP = {("engine/drive.py", "drive"), ("engine/core_proc.py", "CoreLoop.run")}
SINGLE = {("engine/core.py", "LLMEngine.step"), ("engine/core_proc.py", "CoreService.step"),
          ("planner/calibrate.py", "_Runner._step"),
          ("planner/sim_engine.py", "SimulatedEngine.step"),
          ("planner/dp.py", "_replay_routed.advance")}
NOT_AN_ENGINE = {"profiler"}  # torch.profiler's step()


def _step_calls(path: Path) -> list[tuple[str, bool]]:
    """(enclosing function's qualified name, inside a loop of that function) of every zero-argument
    ``x.step()`` call in ``path``."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, scope: list[str], in_loop: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, [*scope, child.name], False)
            elif isinstance(child, ast.ClassDef):
                visit(child, [*scope, child.name], False)
            elif isinstance(child, (ast.For, ast.AsyncFor, ast.While)):
                visit(child, scope, True)
            else:
                if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                        and child.func.attr == "step" and not child.args and not child.keywords
                        and not (isinstance(child.func.value, ast.Name)
                                 and child.func.value.id in NOT_AN_ENGINE)):
                    found.append((".".join(scope), in_loop))
                visit(child, scope, in_loop)

    visit(ast.parse(path.read_text(), str(path)), [], False)
    return found


def _all_step_calls() -> dict[tuple[str, str], bool]:
    calls: dict[tuple[str, str], bool] = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).as_posix()
        for scope, in_loop in _step_calls(path):
            calls[(rel, scope)] = calls.get((rel, scope), False) or in_loop
    return calls


def test_only_drive_and_the_core_busy_loop_step_in_a_loop() -> None:
    calls = _all_step_calls()
    assert ("engine/drive.py", "drive") in calls, "the AST walk found no drive loop: it is broken"
    looping = {k for k, loop in calls.items() if loop}
    assert looping == IN_A_LOOP, (f"engine.step() in a loop outside drive(): "
                                  f"{sorted(looping - IN_A_LOOP)}; run the engine with "
                                  f"pagedllm.engine.drive.drive (on_step sees each step)")
    unknown = set(calls) - IN_A_LOOP - SINGLE
    assert not unknown, f"new callers of step(): {sorted(unknown)}; use drive()"


def test_the_walk_sees_loops_and_scopes(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("class A:\n    def f(self, e):\n        while True:\n            e.step()\n"
                 "    def g(self, e):\n        e.step()\n        profiler.step()\n"
                 "def h(e):\n    for _ in range(2):\n        if e:\n            x = [e.step()]\n")
    assert _step_calls(f) == [("A.f", True), ("A.g", False), ("h", True)]


# -- what drive does, on a fake engine --------------------------------------------------------
@dataclass
class _Out:
    request_id: str
    outputs: list[_Tokens]
    finished: bool


@dataclass
class _Tokens:
    token_ids: list[int]


@dataclass
class _FakeEngine:
    """Each step gives every queued request one token; a request finishes after ``n`` tokens."""

    n: int = 2
    running: dict[str, int] = field(default_factory=dict)
    aborted: list[str] = field(default_factory=list)
    steps: int = 0

    def add(self, rid: str) -> None:
        self.running[rid] = 0

    def step(self) -> list[_Out]:
        self.steps += 1
        outs = []
        for rid in list(self.running):
            self.running[rid] += 1
            done = self.running[rid] == self.n
            outs.append(_Out(rid, [_Tokens(list(range(self.running[rid])))], done))
            if done:
                del self.running[rid]
        return outs

    def abort_request(self, rid: str) -> bool:
        self.aborted.append(rid)
        return self.running.pop(rid, None) is not None

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)


def test_drive_adds_at_arrival_and_stamps_times() -> None:
    eng = _FakeEngine()
    ticks = itertools.count()
    clock = Clock(lambda: float(next(ticks)), sleeps=False)  # one second per reading
    res = drive(eng, [Submission("late", eng.add, 10.0), Submission("a", eng.add, 0.0)], clock)
    assert res.in_order(["a", "late"])[0].finished and res.outputs["late"].finished
    assert res.added["a"] < res.first_token["a"] < res.finished["a"] <= res.added["late"]
    assert res.added["late"] >= 10.0  # idle until it arrived (skipped, not slept)
    assert res.num_steps == eng.steps == 4 and not eng.aborted


def test_drive_waits_for_its_own_requests_only() -> None:
    eng = _FakeEngine()
    eng.running["other"] = -10  # another front end's request on the same engine, a long one
    res = drive(eng, [Submission("mine", eng.add)])
    assert set(res.outputs) == {"mine"} and "other" in eng.running


def test_drive_aborts_what_it_added_when_it_fails() -> None:
    eng = _FakeEngine(n=3)

    def bad(rid: str) -> None:
        raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        drive(eng, [Submission("a", eng.add), Submission("b", bad, 1.0)],
              Clock(itertools.count().__next__, sleeps=False))
    assert eng.aborted == ["a"] and not eng.running


def test_a_request_lost_by_the_engine_is_an_error() -> None:
    eng = _FakeEngine()
    with pytest.raises(RuntimeError, match="without a finished output"):
        drive(eng, [Submission("a", lambda rid: None)])  # never queued: no output will come
