"""Sampling options through ``LLM.generate``: one mixed batch, a different top-k / top-p / min-p /
temperature / penalty mix on every row, against an independent per-request reference
(HF logits processors on HF's logits, tests/sampling_reference.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from sampling_reference import (
    CONFIGS,
    NUM_TOKENS,
    PROMPT,
    SEEDS,
    first_token_counts,
    race_mismatch,
    reference_probs,
    total_variation,
    tv_bound,
    without,
)

from pagedllm import LLM, SamplingParams

KEYS = [(name, s) for s in SEEDS for name in CONFIGS]  # rows of every config side by side


def _llm(path: Path, **kw: int) -> LLM:
    return LLM(model=str(path), block_size=4, max_model_len=64, **kw)


@pytest.fixture(scope="module")
def outputs(sampling_model: Path) -> dict[tuple[str, int], list[int]]:
    """(config, seed) -> generated tokens, all rows in one generate call."""
    llm = _llm(sampling_model, num_kv_blocks=256)
    params = [SamplingParams(max_tokens=NUM_TOKENS, seed=s, ignore_eos=True, **CONFIGS[name])
              for name, s in KEYS]
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * len(KEYS), params, use_tqdm=False)
    assert len(outs) == len(KEYS) == 14
    llm.engine.check_integrity()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    return {k: list(o.outputs[0].token_ids) for k, o in zip(KEYS, outs, strict=True)}


def test_mixed_batch_matches_the_reference_token_for_token(
        sampling_hf: Any, outputs: dict[tuple[str, int], list[int]]) -> None:
    for (name, s), tokens in outputs.items():
        assert len(tokens) == NUM_TOKENS
        step = race_mismatch(sampling_hf, CONFIGS[name], s, tokens)
        assert step is None, f"{name} {CONFIGS[name]}, seed {s}: token {step} is not the reference's"


@pytest.mark.slow
def test_every_option_decides_some_token(sampling_hf: Any,
                                         outputs: dict[tuple[str, int], list[int]]) -> None:
    """The test above can fail: with any one option of a row dropped (or its temperature moved),
    the reference disagrees with the tokens of at least one seed."""
    for name, cfg in CONFIGS.items():
        for option in [o for o in cfg if not (o == "temperature" and cfg[o] == 0.0)]:
            changed = [race_mismatch(sampling_hf, without(cfg, option), s, outputs[(name, s)])
                       is not None for s in SEEDS]
            assert any(changed), f"{name}: dropping {option} changes no token"


@pytest.mark.slow  # 7000 one-token requests
def test_first_token_distribution_matches_the_reference(sampling_model: Path,
                                                        sampling_hf: Any) -> None:
    """No assumption on how the engine draws: 1000 seeded first tokens per row of one mixed
    batch, total-variation distance to the reference under the bound it exceeds with
    probability < 1e-6 (sampling_reference.tv_bound), and nothing outside the support."""
    n = 1000
    with torch.no_grad():
        logits = sampling_hf(torch.tensor([PROMPT])).logits[0, -1]
    counts = first_token_counts(_llm(sampling_model, num_kv_blocks=1024, max_num_seqs=256), n)
    for name, cfg in CONFIGS.items():
        p = reference_probs(logits, PROMPT, [], cfg)
        assert int(counts[name][p == 0].sum()) == 0, f"{name}: a token outside the support"
        tv, bound = total_variation(counts[name], p), tv_bound(p, n)
        assert tv < bound, f"{name}: TV {tv:.3f} >= {bound:.3f}"
