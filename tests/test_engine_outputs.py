"""RequestOutput kinds: DELTA outputs add up to the CUMULATIVE ones, FINAL_ONLY gives one output,
and each carries only what its kind promises."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedllm import LLM, LLMEngine, RequestOutputKind, SamplingParams
from pagedllm.outputs import RequestOutput


@pytest.fixture(scope="module")
def engine(tiny_models: dict[str, Path]) -> LLMEngine:
    return LLM(model=str(tiny_models["llama"]), block_size=4, num_kv_blocks=200,
               max_model_len=128).engine


def _run(engine: LLMEngine, params: list[SamplingParams]) -> dict[str, list[RequestOutput]]:
    prompts = [[5, 6, 7], [20, 21], [9, 30, 31, 32, 33]]
    for i, sp in enumerate(params):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompts[i % len(prompts)]}, sp)
    seen: dict[str, list[RequestOutput]] = {f"r{i}": [] for i in range(len(params))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    engine.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return seen


def _params(kind: RequestOutputKind, stop: list[str]) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=1,
                       output_kind=kind),
        SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True, logprobs=1,
                       stop=stop, output_kind=kind),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop=stop, output_kind=kind),
    ]


def _stop_words(engine: LLMEngine) -> list[str]:
    """Words the sampled continuations of request 1 do produce, so that stop strings fire."""
    out = _run(engine, _params(RequestOutputKind.CUMULATIVE, []))["r1"][-1]
    return [c.text.split()[3] for c in out.outputs[:2]]


def test_deltas_add_up_to_the_cumulative_outputs(engine: LLMEngine) -> None:
    stop = _stop_words(engine)
    full = _run(engine, _params(RequestOutputKind.CUMULATIVE, stop))
    deltas = _run(engine, _params(RequestOutputKind.DELTA, stop))
    assert any(c.finish_reason == "stop" for c in full["r1"][-1].outputs)
    for rid, outs in deltas.items():
        final = full[rid][-1]
        assert final.finished and outs[-1].finished and not any(o.finished for o in outs[:-1])
        acc = RequestOutput(rid, outs[0].prompt, outs[0].prompt_token_ids, None, [], False)
        finishes: dict[int, int] = {}
        for o in outs:
            assert o.outputs, "a delta output with no sequence in it"
            for c in o.outputs:
                assert c.text or c.finish_reason is not None, "an empty, unfinished delta"
                assert not finishes.get(c.index), "a sequence delivered after it finished"
                finishes[c.index] = finishes.get(c.index, 0) + (c.finish_reason is not None)
                assert c.logprobs is None or len(c.logprobs) == len(c.token_ids)
            acc.add(o)
        assert finishes == {c.index: 1 for c in final.outputs}
        assert acc.prompt_logprobs == final.prompt_logprobs
        assert [o.prompt_logprobs is not None for o in outs].count(True) == (rid == "r0")
        for mine, ref in zip(acc.outputs, final.outputs, strict=True):
            assert (mine.index, mine.text, mine.token_ids, mine.finish_reason, mine.stop_reason) == (
                ref.index, ref.text, ref.token_ids, ref.finish_reason, ref.stop_reason)
            assert mine.logprobs == ref.logprobs and mine.cumulative_logprob == ref.cumulative_logprob
    # every step emits: the per-step cumulative outputs and the deltas come as often
    assert len(deltas["r0"]) == len(full["r0"]) == 12


def test_final_only_gives_one_output_equal_to_the_cumulative_one(engine: LLMEngine) -> None:
    stop = _stop_words(engine)
    full = _run(engine, _params(RequestOutputKind.CUMULATIVE, stop))
    final = _run(engine, _params(RequestOutputKind.FINAL_ONLY, stop))
    for rid, outs in final.items():
        assert len(outs) == 1 and outs[0].finished
        ref = full[rid][-1]
        assert [(c.text, c.token_ids, c.logprobs, c.finish_reason) for c in outs[0].outputs] == [
            (c.text, c.token_ids, c.logprobs, c.finish_reason) for c in ref.outputs]
        assert outs[0].prompt_logprobs == ref.prompt_logprobs
