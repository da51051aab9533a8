"""Presence / frequency / repetition penalties through the whole engine, against independent
references: HF ``generate(repetition_penalty=...)``, and a plain loop over HF's forward that
applies the OpenAI formula (``logit - frequency * count - presence * (count > 0)``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 5, 6], [9], [40] * 12 + [41, 42], [100, 101, 102, 103]]
N = 24


@pytest.fixture(scope="module")
def hf(tiny_models: dict[str, Path]) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32).eval()


def _engine(tiny_models: dict[str, Path], **kw: int) -> LLM:
    return LLM(model=str(tiny_models["llama"]), block_size=4, max_model_len=56, **kw)


def _run(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert len(outs) == len(PROMPTS)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert all(len(g) == N for g in got)  # ignore_eos: every request runs its max_tokens
    return got


def _reference(hf: torch.nn.Module, prompt: list[int], presence: float, frequency: float) -> list[int]:
    ids = list(prompt)
    counts = torch.zeros(hf.config.vocab_size)
    with torch.no_grad():
        for _ in range(N):
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
            logits = logits - frequency * counts - presence * (counts > 0).float()
            tok = int(logits.argmax())
            ids.append(tok)
            counts[tok] += 1
    return ids[len(prompt):]


def test_repetition_penalty_matches_hf(tiny_models: dict[str, Path], hf: torch.nn.Module) -> None:
    got = _run(_engine(tiny_models, num_kv_blocks=128),
               [SamplingParams(temperature=0, max_tokens=N, ignore_eos=True,
                               repetition_penalty=1.6)] * len(PROMPTS))
    for p, g in zip(PROMPTS, got, strict=True):
        with torch.no_grad():
            seq = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=N, do_sample=False, repetition_penalty=1.6,
                              eos_token_id=None, pad_token_id=0)
        assert g == seq[0, len(p):].tolist()


@pytest.mark.parametrize("num_kv_blocks", [128, pytest.param(14, marks=pytest.mark.slow)])  # 14: forced preemption by recompute
def test_presence_and_frequency_penalties_match_the_formula(
        tiny_models: dict[str, Path], hf: torch.nn.Module, num_kv_blocks: int) -> None:
    """Mixed batch: penalised and plain requests side by side; counts carried across steps."""
    settings = [(0.0, 1.5), (2.0, 0.0), (0.0, 0.0), (0.7, 0.9)]
    params = [SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, presence_penalty=pr,
                             frequency_penalty=fr) for pr, fr in settings]
    llm = _engine(tiny_models, num_kv_blocks=num_kv_blocks, max_num_seqs=4)
    got = _run(llm, params)
    for p, (pr, fr), g in zip(PROMPTS, settings, got, strict=True):
        assert g == _reference(hf, p, pr, fr)
    if num_kv_blocks == 14:
        assert llm.engine.num_preemptions > 0
    # every request's penalty slot came back (slot 0: the plain rows' zero row, never handed out)
    pc = llm.engine.runner.penalty_counts
    assert not pc.slots and sorted(pc.free) == list(range(1, pc.counts.shape[0]))
    assert not pc.counts[0].any() and not pc.prompt[0].any()
    assert _run(llm, params) == got  # recycled (zeroed) slots give the same result
