"""Bad input offline: every token id a request carries is checked against the vocabulary at
admission (ValueError naming the field, nothing queued), text with lone surrogates is refused,
the context is what bounds an omitted max_tokens, and a request that goes bad inside a step fails
alone (finish_reason "error"), leaving every block back and the others' outputs unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import assert_idle

from pagedllm import LLM, SamplingParams
from pagedllm.request import RequestStatus


@pytest.fixture(scope="module")
def llm(tiny_models: dict[str, Path]) -> LLM:
    return LLM(model=str(tiny_models["llama"]), block_size=4, num_kv_blocks=200, max_model_len=64)


@pytest.mark.parametrize(("params", "field"), [
    (dict(stop_token_ids=[99999], min_tokens=3), "stop_token_ids"),
    (dict(stop_token_ids=[99999]), "stop_token_ids"),
    (dict(stop_token_ids=[-5], min_tokens=3), "stop_token_ids"),
    (dict(stop_token_ids=[512]), "stop_token_ids"),  # == vocab_size
])
def test_out_of_vocab_ids_in_params_are_refused_at_admission(llm: LLM, params: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"{field}=.*outside the vocabulary \[0, 512\)"):
        llm.generate("t5", SamplingParams(max_tokens=4, **params), use_tqdm=False)
    assert_idle(llm.engine)
    # the engine keeps serving: a valid request afterwards runs to the end
    ok = llm.generate("t5", SamplingParams(max_tokens=4, ignore_eos=True, stop_token_ids=[511]),
                      use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) in range(1, 5)


def test_lone_surrogates_are_refused_in_prompts_and_stop_strings(llm: LLM) -> None:
    for prompt in ("\ud800abc", {"prompt": "t5 \udfff"}):
        with pytest.raises(ValueError, match=r"prompt contains a lone UTF-16 surrogate \(U\+D[8F]..\ at"):
            llm.generate(prompt, use_tqdm=False)
    with pytest.raises(ValueError, match=r"stop=.*lone UTF-16 surrogate \(U\+D800 at character 0\)"):
        SamplingParams(stop=["ok", "\ud800"])
    assert_idle(llm.engine)


def test_omitted_max_tokens_is_what_the_context_leaves(llm: LLM) -> None:
    """vLLM's offline rule: max_tokens=None generates up to max_model_len; min_tokens above that
    room is refused (it could never be met)."""
    out = llm.generate({"prompt_token_ids": [5] * 50}, SamplingParams(max_tokens=None, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 14 and out.finish_reason == "length"
    with pytest.raises(ValueError, match=r"min_tokens=20 .*14"):
        llm.generate({"prompt_token_ids": [5] * 50},
                     SamplingParams(max_tokens=None, min_tokens=20, ignore_eos=True), use_tqdm=False)
    assert_idle(llm.engine)


def test_a_request_that_goes_bad_inside_a_step_fails_alone(llm: LLM) -> None:
    """A request whose state turns invalid after admission (here: an out-of-vocab stop id written
    into its live params, the IndexError of issue #19 inside the sampler) ends with
    finish_reason "error"; the step is rerun for the others, whose greedy outputs equal a run
    without the bad request, and every block comes back."""
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["t5 t6 t7", "t9 t10", "t11 t12 t13 t14 t15"]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    for i, p in enumerate(prompts):
        eng.add_request(f"ok{i}", p, sp)
    eng.add_request("bad", "t20 t21", SamplingParams(temperature=0, max_tokens=12, n=2, ignore_eos=True))
    for _ in range(3):
        eng.step()
    for child in ("bad#0", "bad#1"):
        req = eng.scheduler.requests[child]
        req.params = req.params.clone(stop_token_ids=[99999], min_tokens=12)  # bypasses admission
    got: dict[str, list[int]] = {}
    errors = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.request_id == "bad":
                assert out.finished
                errors += [c.finish_reason for c in out.outputs]
            elif out.finished:
                got[out.request_id] = out.outputs[0].token_ids
        eng.check_integrity()
    assert errors == ["error", "error"]
    assert [got[f"ok{i}"] for i in range(3)] == alone
    assert RequestStatus.FINISHED_ERROR.value == "error"
    assert_idle(llm.engine)


def test_a_step_failure_no_request_explains_still_raises(llm: LLM) -> None:
    """When re-validation finds no culprit the failure is the engine's: step() raises it (the
    server fails the batch), and aborting the requests gives every block back."""
    eng = llm.engine
    eng.add_request("x", "t5 t6", SamplingParams(max_tokens=8))
    real = eng.runner.execute

    def boom(sched: object) -> object:
        raise RuntimeError("injected")

    eng.runner.execute = boom  # type: ignore[method-assign]
    try:
        with pytest.raises(RuntimeError, match="injected"):
            eng.step()
    finally:
        eng.runner.execute = real  # type: ignore[method-assign]
    assert eng.abort_request("x")
    assert_idle(llm.engine)
