"""Random add / step / abort against the offline engine on a tiny pool (hypothesis), with random,
partly invalid prompts and SamplingParams, and requests poisoned after admission.

Whatever comes in, only ValueError escapes ``SamplingParams(...)``, ``add_request`` and
``add_beam_search``; ``step()`` never raises; ``check_integrity()`` holds after every rule; a
poisoned request ends with finish_reason "error"; and once everything is aborted or done every
block is back in the pool.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import assert_idle
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from pagedllm import LLMEngine, SamplingParams
from pagedllm.sampling_params import RequestOutputKind

VOCAB = 512
MAX_LEN = 32

word = st.integers(0, VOCAB - 1).map(lambda i: f"t{i}")
PROMPTS = st.one_of(
    st.lists(word, min_size=1, max_size=12).map(" ".join),
    st.lists(word, min_size=1, max_size=12).map(" ".join),  # valid text twice as often
    st.lists(word, max_size=3).map(lambda w: " ".join(w) + " \ud800"),  # lone surrogate
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=14).map(lambda ids: {"prompt_token_ids": ids}),
    st.lists(st.integers(-3, VOCAB + 3), max_size=6).map(lambda ids: {"prompt_token_ids": ids}),
    st.integers(MAX_LEN - 2, MAX_LEN + 2).map(lambda n: [7] * n),  # around the context limit
    st.sampled_from([{}, {"prompt": 5}, {"prompt_token_ids": "t5"}]),
)
VALID = {
    "n": st.integers(1, 4),
    "temperature": st.sampled_from([0.0, 0.7, 1.0]),
    "top_p": st.sampled_from([0.5, 1.0]),
    "top_k": st.sampled_from([-1, 0, 1, 5, VOCAB + 10]),
    "min_p": st.sampled_from([0.0, 0.2]),
    "presence_penalty": st.sampled_from([0.0, 1.5]),
    "frequency_penalty": st.sampled_from([0.0, 0.5]),
    "repetition_penalty": st.sampled_from([1.0, 1.3]),
    "max_tokens": st.one_of(st.none(), st.integers(1, 20)),
    "min_tokens": st.integers(0, 3),
    "seed": st.one_of(st.none(), st.integers(0, 2**31)),
    "stop": st.lists(st.sampled_from(["t5", "t9 t1", "t"]), max_size=2),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
    "ignore_eos": st.booleans(),
    "logprobs": st.one_of(st.none(), st.integers(0, 3)),
    "prompt_logprobs": st.one_of(st.none(), st.integers(0, 2)),
    "output_kind": st.sampled_from(list(RequestOutputKind)),
}
INVALID = {  # values SamplingParams or admission must refuse
    "n": [-1, 0, 99], "temperature": [-1.0, 1e9], "top_p": [0.0, 1.5], "top_k": [-2],
    "min_p": [-0.1, 1.5], "presence_penalty": [-3.0], "repetition_penalty": [0.0],
    "max_tokens": [-1, 0], "min_tokens": [-1, 25, 40], "logprobs": [-1, 21],
    "stop": [[""], ["\udc00"], ["ok", "x\ud800"]], "stop_token_ids": [[-2], [VOCAB], [10**6, 5]],
}


@st.composite
def params(draw: st.DrawFn) -> dict[str, Any]:
    """Mostly valid keyword arguments; one time in three, one field is made invalid."""
    kwargs = draw(st.fixed_dictionaries({}, optional=VALID))
    if draw(st.integers(0, 2)) == 0:
        name = draw(st.sampled_from(sorted(INVALID)))
        kwargs[name] = draw(st.sampled_from(INVALID[name]))
    return kwargs


class EngineMachine(RuleBasedStateMachine):
    engine: LLMEngine  # set by the test: one engine for every example

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # unseeded sampling draws from here: replays sample alike
        self.live: set[str] = set()
        self.poisoned: dict[str, set[int]] = {}  # request -> choices that must end in "error"
        self.next_id = 0

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    @rule(prompt=PROMPTS, kwargs=params())
    def add(self, prompt: Any, kwargs: dict[str, Any]) -> None:
        rid = self._new_id()
        try:
            self.engine.add_request(rid, prompt, SamplingParams(**kwargs))
        except ValueError:
            assert rid not in self.engine.request_ids()  # refused: nothing of it stays
            return
        self.live.add(rid)

    @rule(prompt=PROMPTS, width=st.integers(-1, 5), max_tokens=st.integers(-1, 12))
    def add_beam(self, prompt: Any, width: int, max_tokens: int) -> None:
        rid = self._new_id()
        try:
            self.engine.add_beam_search(rid, prompt, width, max_tokens)
        except ValueError:
            return
        self.live.add(rid)

    @rule(times=st.integers(1, 6))
    def step(self, times: int) -> None:
        for _ in range(times):
            if not self.engine.has_unfinished_requests():
                return
            for out in self.engine.step():
                reasons = {c.index: c.finish_reason for c in out.outputs}
                for index in self.poisoned.get(out.request_id, ()):
                    assert reasons.get(index) in (None, "error"), (out.request_id, reasons)
                if out.request_id not in self.poisoned:
                    assert "error" not in reasons.values(), (out.request_id, reasons)
                if out.finished:
                    self.live.discard(out.request_id)

    # Rules draw the same values whatever the engine's state (a pick is an index into what is
    # live): hypothesis replays examples and must see the same draws.
    @rule(known=st.booleans(), pick=st.integers(0, 1000))
    def abort(self, known: bool, pick: int) -> None:
        if self.live and known:
            rid = sorted(self.live)[pick % len(self.live)]
            assert self.engine.abort_request(rid)
            self.live.discard(rid)
        else:
            assert not self.engine.abort_request("never-added")

    @rule(pick=st.integers(0, 1000), ids=st.lists(st.sampled_from([-4, VOCAB, 10**6]), min_size=1, max_size=2))
    def poison(self, pick: int, ids: list[int]) -> None:
        """Make a live request invalid behind admission's back (as a bug elsewhere would)."""
        reqs = sorted((r for r in self.engine.scheduler.requests.values()
                       if self.engine.output.owns(r.request_id) and not r.is_finished),
                      key=lambda r: r.request_id)
        if not reqs:
            return
        r = reqs[pick % len(reqs)]
        bound = r.params.max_tokens if r.params.max_tokens is not None else MAX_LEN
        r.params = r.params.clone(stop_token_ids=ids, min_tokens=bound)  # every sample bans them
        group = self.engine.output.group_of(r.request_id)
        assert group is not None
        choices = self.poisoned.setdefault(group, set())
        index = int(r.request_id.rpartition("#")[2] or 0) if "#" in r.request_id else 0
        if any(i >= VOCAB for i in ids):  # out of range: the step fails (a negative id wraps)
            choices.add(index)
        else:  # the ids replace an earlier poison's: this sequence no longer fails
            choices.discard(index)

    @invariant()
    def intact(self) -> None:
        self.engine.check_integrity()
        assert set(self.engine.request_ids()) == self.live

    def teardown(self) -> None:
        for rid in list(self.live):
            assert self.engine.abort_request(rid)
        assert_idle(self.engine)


@pytest.fixture(scope="module")
def engine(tiny_models: dict[str, Path]) -> LLMEngine:
    return LLMEngine.from_args(model=str(tiny_models["llama"]), block_size=4, num_kv_blocks=10,
                               max_model_len=MAX_LEN, max_num_seqs=4, max_num_batched_tokens=16,
                               swap_space=0.001)


def _run(engine: LLMEngine, examples: int) -> None:
    EngineMachine.engine = engine
    run_state_machine_as_test(EngineMachine, settings=settings(
        max_examples=examples, stateful_step_count=25, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))


def test_random_add_step_abort_only_value_errors_and_every_block_back(engine: LLMEngine) -> None:
    _run(engine, 10)


@pytest.mark.slow
def test_random_add_step_abort_long(engine: LLMEngine) -> None:
    _run(engine, 300)
