"""The offline API and LLMEngine: input forms, sampling options, errors that lose nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import assert_idle

from pagedllm import LLM, LLMEngine, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_models: dict[str, Path]) -> LLM:
    return LLM(model=str(tiny_models["llama"]), block_size=4, num_kv_blocks=200, max_model_len=256)


def test_prompt_forms_and_output_order(llm: LLM) -> None:
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    a = llm.generate("t5 t6 t7", sp, use_tqdm=False)
    b = llm.generate([{"prompt_token_ids": [5, 6, 7]}, "t9 t9", {"prompt": "t5 t6 t7"}], sp, use_tqdm=False)
    assert a[0].prompt == "t5 t6 t7" and a[0].prompt_token_ids == [5, 6, 7]
    assert b[0].outputs[0].token_ids == a[0].outputs[0].token_ids == b[2].outputs[0].token_ids
    assert b[1].prompt_token_ids == [9, 9]
    # the continuation of a word-level text starts with the separating space
    assert a[0].outputs[0].text == "".join(f" t{i}" for i in a[0].outputs[0].token_ids)
    assert_idle(llm.engine)


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm: LLM) -> None:
    sp = SamplingParams(temperature=1.0, seed=42, max_tokens=8, ignore_eos=True)
    alone = llm.generate("t10 t11", sp, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    mixed = llm.generate(["t3 t4 t5 t6", "t10 t11", "t7"], [others, sp, others], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone


def test_n_samples_and_stop_strings(llm: LLM) -> None:
    sp = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True)
    out = llm.generate("t20", sp, use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    greedy = llm.generate("t20", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    words = greedy.outputs[0].text.split()
    stop_word = words[2]
    stopped = llm.generate("t20", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop=[stop_word]),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_word
    assert stop_word not in stopped.text and greedy.outputs[0].text.startswith(stopped.text)
    assert_idle(llm.engine)


def test_stop_token_ids_and_min_tokens(llm: LLM) -> None:
    greedy = llm.generate("t30 t31", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    first = greedy[0].outputs[0].token_ids[0]
    out = llm.generate("t30 t31", SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[first]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [first] and out.finish_reason == "stop" and out.stop_reason == first
    banned = llm.generate("t30 t31", SamplingParams(temperature=0, max_tokens=5, min_tokens=2, stop_token_ids=[first]),
                          use_tqdm=False)[0].outputs[0]
    assert banned.token_ids[0] != first and len(banned.token_ids) >= 2
    assert first not in banned.token_ids[:2]


def _hf_min_tokens(model, prompt: list[int], stop: int, min_tokens: int, n: int):  # type: ignore[no-untyped-def]
    """Greedy over HF's forward with ``stop`` banned for the first ``min_tokens`` steps and ending
    the output afterwards: (tokens, steps whose unbanned argmax was ``stop``)."""
    import torch

    ids, out, bit = list(prompt), [], []
    for step in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        if step < min_tokens:
            bit += [step] if int(logits.argmax()) == stop else []
            logits[stop] = float("-inf")
        out.append(int(logits.argmax()))
        ids.append(out[-1])
        if step >= min_tokens and out[-1] == stop:
            break
    return out, bit


@pytest.mark.parametrize("min_tokens", [2, 3])
def test_min_tokens_bans_stop_tokens_for_every_early_step(llm: LLM, tiny_models: dict[str, Path],
                                                          min_tokens: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32).eval()
    prompt = [30, 31]
    first = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1),
                         use_tqdm=False)[0].outputs[0].token_ids[0]
    want, bit = _hf_min_tokens(hf, prompt, first, min_tokens, 12)
    # Unbanned, the stop token would win steps 0 and 2: min_tokens=3 must ban it at step 2 too
    # (a ban on the first step only stops there); min_tokens=2 ends with it at step 2.
    assert bit == {2: [0], 3: [0, 2]}[min_tokens]
    sp = SamplingParams(temperature=0, max_tokens=12, min_tokens=min_tokens, stop_token_ids=[first])
    out = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == want
    assert out.finish_reason == ("stop" if want[-1] == first else "length")
    assert first not in out.token_ids[:min_tokens]
    assert_idle(llm.engine)


def test_invalid_input_raises_and_loses_nothing(llm: LLM) -> None:
    with pytest.raises(ValueError, match="temperature"):
        llm.generate("t5", SamplingParams(temperature=-1), use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [5] * 300}, use_tqdm=False)
    with pytest.raises(ValueError, match="outside"):
        llm.generate({"prompt_token_ids": [5, 100000]}, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(ValueError, match="n=65 exceeds max_num_seqs=64"):
        llm.generate("t5", SamplingParams(n=65), use_tqdm=False)
    # a bad prompt in the middle of a batch: nothing of the batch stays queued
    with pytest.raises(ValueError):
        llm.generate(["t5", {"prompt_token_ids": [5] * 300}, "t6"], use_tqdm=False)
    assert_idle(llm.engine)
    ok = llm.generate("t5", SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) == 2


def test_engine_streaming_and_abort(tiny_models: dict[str, Path]) -> None:
    eng = LLMEngine.from_args(model=str(tiny_models["llama"]), num_kv_blocks=64, block_size=8, max_model_len=256)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    eng.add_request("x", "t5 t6", sp)
    eng.add_request("y", "t7 t8 t9", sp)
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("x", "t1", sp)
    seen: dict[str, int] = {}
    for _ in range(3):
        for o in eng.step():
            seen[o.request_id] = len(o.outputs[0].token_ids)
    assert seen == {"x": 3, "y": 3}
    assert eng.abort_request("y") and not eng.abort_request("y")
    finished = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            assert o.request_id == "x"
            finished = o
    assert finished is not None and finished.finished and len(finished.outputs[0].token_ids) == 20
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_startup_refuses_a_pool_too_small_for_max_model_len(tiny_models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="lower --max-model-len or raise --kv-cache-memory"):
        LLM(model=str(tiny_models["llama"]), num_kv_blocks=4, block_size=16, max_model_len=512)
    with pytest.raises(ValueError, match="supports"):
        bad = tiny_models["llama"].parent / "bad"
        bad.mkdir(exist_ok=True)
        (bad / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
        LLM(model=str(bad))
