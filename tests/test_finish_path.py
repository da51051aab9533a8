"""One way a sequence ends. In the core, ``Scheduler.finish_request`` alone gives a request a
finished status; it is called by the scheduler's ``update`` (token-level stops) and by
``EngineCore._finish`` (everything else the core decides). A stop string is found by the front
end, which finishes the sequence there and sends the core an abort. The core's outputs are plain
data without text."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import msgspec
import pytest

from pagedllm import LLM, LLMEngine, SamplingParams
from pagedllm.engine.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    TokenLogprobs,
    encoder,
    from_core_decoder,
)
from pagedllm.engine.output import OutputProcessor
from pagedllm.request import RequestStatus
from pagedllm.sched import Scheduler

PKG = Path(__file__).resolve().parent.parent / "pagedllm"
NOT_FINISHED = {"WAITING", "RUNNING"}


def _functions(tree: ast.AST) -> dict[ast.AST, str]:
    """Each node -> the qualified name of the function it is in ("Class.method")."""
    owner: dict[ast.AST, str] = {}

    def visit(node: ast.AST, name: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, child.name)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, f"{name}.{child.name}" if name else child.name)
            else:
                owner[child] = name
                visit(child, name)

    visit(tree, "")
    return owner


def _sites(match: Any) -> set[str]:
    found = set()
    for path in PKG.rglob("*.py"):
        tree = ast.parse(path.read_text())
        owner = _functions(tree)
        for node in ast.walk(tree):
            if match(node):
                found.add(f"{path.relative_to(PKG).as_posix()}:{owner.get(node, '')}")
    return found


def _sets_status(node: ast.AST) -> bool:
    """``x.status = v`` where v is a finished ``RequestStatus.X`` or a variable (which may hold
    one); not RequestStatus.WAITING / RUNNING, nor another object's field (an HTTP status)."""
    if not isinstance(node, ast.Assign):
        return False
    if not any(isinstance(t, ast.Attribute) and t.attr == "status" for t in node.targets):
        return False
    v = node.value
    if isinstance(v, ast.Attribute) and isinstance(v.value, ast.Name) and v.value.id == "RequestStatus":
        return v.attr not in NOT_FINISHED
    return isinstance(v, ast.Name)


def _calls_finish_request(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "finish_request")


def test_only_finish_request_sets_a_finished_status() -> None:
    # the benchmarks' contiguous baseline is a Scheduler whose finish_request is its own
    assert _sites(_sets_status) == {"sched/scheduler.py:Scheduler.finish_request",
                                    "bench/contiguous.py:ContiguousScheduler.finish_request"}


def test_finish_request_is_called_from_update_and_the_cores_finish_only() -> None:
    assert _sites(_calls_finish_request) == {"sched/scheduler.py:Scheduler.update",
                                             "engine/engine_core.py:EngineCore._finish"}


def test_the_structure_checks_see_a_second_finish_site(tmp_path: Path) -> None:
    """The checks above would fail on code that finishes a request elsewhere."""
    code = ("class Grammar:\n    def advance(self, req):\n"
            "        req.status = RequestStatus.FINISHED_STOPPED\n"
            "        self.scheduler.finish_request(req.request_id, s)\n")
    tree = ast.parse(code)
    owner = _functions(tree)
    hits = [owner[n] for n in ast.walk(tree) if _sets_status(n) or _calls_finish_request(n)]
    assert hits == ["Grammar.advance", "Grammar.advance"]


@pytest.fixture(scope="module")
def engine(tiny_models: dict[str, Path]) -> LLMEngine:
    return LLM(model=str(tiny_models["llama"]), block_size=4, num_kv_blocks=200,
               max_model_len=128).engine


def _greedy_words(engine: LLMEngine, prompt: list[int], n: int) -> list[str]:
    engine.add_request("probe", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
    return text.split()


def test_every_end_passes_finish_request_once_and_stop_strings_abort_in_the_core(
        engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    words = _greedy_words(engine, [5, 6, 7], 6)
    ended: list[tuple[str, RequestStatus]] = []
    real = Scheduler.finish_request

    def spy(self: Scheduler, request_id: str, status: RequestStatus) -> Any:
        req = real(self, request_id, status)
        if req is not None:
            ended.append((request_id, status))
        return req

    monkeypatch.setattr(Scheduler, "finish_request", spy)
    aborts: list[list[str]] = []
    real_abort = engine.core.abort_requests
    def abort(ids: list[str], step: Any = None) -> list[str]:
        aborts.append(list(ids))
        return real_abort(ids, step)

    monkeypatch.setattr(engine.core, "abort_requests", abort)
    wire_enc, wire_dec = encoder(), from_core_decoder()
    real_step = engine.core.step

    def step() -> EngineCoreOutputs:
        outs = real_step()  # plain data: it crosses a process boundary as it is
        assert msgspec.structs.asdict(wire_dec.decode(wire_enc.encode(outs)))["outputs"] == \
            msgspec.structs.asdict(outs)["outputs"]
        return outs

    monkeypatch.setattr(engine.core, "step", step)
    length = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    stop_str = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=[words[2]])
    n_stop = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True,
                            stop=[words[1]])
    engine.add_request("len", {"prompt_token_ids": [5, 6, 7]}, length)
    engine.add_request("str", {"prompt_token_ids": [5, 6, 7]}, stop_str)
    engine.add_request("n", {"prompt_token_ids": [5, 6, 7]}, n_stop)
    engine.add_request("gone", {"prompt_token_ids": [9, 9]}, length)
    engine.step()
    assert engine.abort_request("gone")
    final: dict[str, Any] = {}
    reasons: list[str] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        engine.check_integrity()
        # the step's record, with its request events, brought up to date after the aborts
        s, sched = engine.stats, engine.scheduler
        assert s.step == sched.num_steps and s.num_running == sched.num_running
        assert s.kv.free == engine.kv.num_free_blocks
        reasons += s.finish_reasons
    assert sorted(reasons) == sorted(["length", "stop"] + [c.finish_reason for c in final["n"].outputs])
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    by_id = dict(ended)
    assert len(by_id) == len(ended), f"a sequence was finished twice: {ended}"
    assert by_id["len"] == RequestStatus.FINISHED_LENGTH
    assert by_id["gone"] == RequestStatus.FINISHED_ABORTED
    # the stop string ended "str" in the front end; the core was told by an abort
    assert final["str"].outputs[0].finish_reason == "stop"
    assert final["str"].outputs[0].stop_reason == words[2]
    assert final["str"].outputs[0].text.split() == words[:2]
    assert by_id["str"] == RequestStatus.FINISHED_ABORTED and ["str"] in aborts
    # n > 1: a sequence that met the stop string is aborted alone, by its own id
    for c in final["n"].outputs:
        sid = f"n#{c.index}"
        if c.finish_reason == "stop":
            assert [sid] in aborts and by_id[sid] == RequestStatus.FINISHED_ABORTED
        else:
            assert c.finish_reason == "length" and by_id[sid] == RequestStatus.FINISHED_LENGTH


def test_a_stop_string_among_accepted_proposals_drops_the_tokens_past_it(
        engine: LLMEngine) -> None:
    """The front end cuts a step's tokens at the stop string (several arrive at once with
    speculative decoding; here one output with three tokens, as the core sends it)."""
    proc = OutputProcessor(engine.tokenizer)
    proc.add("x", None, [5, 6], SamplingParams(stop=["t8"], logprobs=0), 0.0)
    lps = [TokenLogprobs(-1.0, 1, []) for _ in range(3)]
    done = proc.process(EngineCoreOutputs(outputs=[EngineCoreOutput(
        request_id="x", new_token_ids=[7, 8, 9], new_logprobs=lps)]))
    assert done.aborts == ["x"]
    (out,) = done.outputs
    c = out.outputs[0]
    assert out.finished and c.finish_reason == "stop" and c.stop_reason == "t8"
    assert c.token_ids == [7, 8] and c.text == " t7 " and c.cumulative_logprob == -2.0
    later = proc.process(EngineCoreOutputs(outputs=[EngineCoreOutput(request_id="x",
                                                                     new_token_ids=[10])]))
    assert later.outputs == [] and later.aborts == []  # the core's step before the abort: dropped
