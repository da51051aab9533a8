"""Sliding-window models against HF transformers (fp32 greedy, token-identical) with the blocks
that leave the window freed: prompts and generations far past the window, prefix hits on the
window's blocks, forced preemption by recompute and by swap; after every step the pool is
consistent and no request holds more than ``ceil(window / block_size) + 1`` blocks.

The default suite runs window 32 at block size 16 on 120-token prompts; ``-m slow`` runs
windows 32 and 64 x block sizes 1 and 16 x both preemption modes on 600-token prompts with
600-token generations, a 2,000-token generation, and a Qwen2 mixing full and windowed layers.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm import LLM, SamplingParams

_HF: dict[tuple[str, tuple[int, ...], int], list[int]] = {}
_IDS = itertools.count()


def hf_greedy(path: Path, prompt: list[int], max_new: int) -> list[int]:
    key = (str(path), tuple(prompt), max_new)
    if key not in _HF:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                 dtype=torch.long), max_new_tokens=max_new, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        _HF[key] = out[0, len(prompt):].tolist()
    return _HF[key]


@pytest.fixture(scope="module")
def windowed(make_model: Any) -> dict[int, Path]:
    return {w: make_model("mistral", sliding_window=w, max_position_embeddings=2560)
            for w in (32, 64)}


def make_prompts(n: int, shared: int, seed: int = 0) -> list[list[int]]:
    """p0 of n tokens, p1 sharing its first ``shared`` (far more than a window), p2 short."""
    rng = random.Random(seed)
    p0 = [rng.randrange(4, 512) for _ in range(n)]
    p1 = p0[:shared] + [rng.randrange(4, 512) for _ in range(n - shared)]
    return [p0, p1, [rng.randrange(4, 512) for _ in range(20)]]


def run_checked(llm: LLM, prompts: list[list[int]], max_tokens: int, window: int,
                block_size: int) -> list[list[int]]:
    """Generate through engine steps; after each: integrity, and the per-request bound."""
    eng = llm.engine
    bound = -(-window // block_size) + 1
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"w{next(_IDS)}" for _ in prompts]
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, {"prompt_token_ids": p}, params)
    done: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = list(o.outputs[0].token_ids)
        eng.check_integrity()
        stats = eng.kv_stats()
        assert stats["max_blocks_per_request"] <= bound, stats
    return [done[i] for i in ids]


def check_against_hf(path: Path, window: int, block_size: int, mode: str, n: int,
                     max_tokens: int, num_kv_blocks: int, hits_expected: bool = True) -> None:
    prompts = make_prompts(n, shared=3 * n // 4)
    llm = LLM(model=str(path), block_size=block_size, num_kv_blocks=num_kv_blocks,
              max_model_len=n + max_tokens + 8, max_num_batched_tokens=96, reserved_fraction=0.0,
              preemption_mode=mode, swap_space=0.01 if mode == "swap" else 0)
    assert llm.engine.kv.sliding_window == window
    first = run_checked(llm, prompts[:1], max_tokens, window, block_size)  # fills the cache
    outs = run_checked(llm, [prompts[1], prompts[2], prompts[0]], max_tokens, window, block_size)
    stats = llm.kv_stats()
    assert stats["num_preemptions"] > 0 and stats["preemptions_by_kind"][mode] > 0
    assert stats["window_freed_blocks"] > 0
    if hits_expected:
        assert stats["prefix_cache_hits"] > 0
    assert stats["used_blocks"] == 0
    assert first[0] == outs[2]
    for p, got in zip([prompts[1], prompts[2], prompts[0]], outs):
        assert got == hf_greedy(path, p, max_tokens), f"prompt of {len(p)} tokens diverged"


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_window_32_matches_hf_under_preemption_and_prefix_hits(windowed: dict[int, Path],
                                                               mode: str) -> None:
    check_against_hf(windowed[32], 32, 16, mode, n=120, max_tokens=60, num_kv_blocks=8)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("window", [32, 64])
def test_600_token_prompts_and_generations_match_hf(windowed: dict[int, Path], window: int,
                                                    block_size: int, mode: str) -> None:
    # three requests decoding hold 3 * per_req blocks: one more than two windows forces
    # preemption. Recomputed requests hit their own window; swapped ones are never recomputed,
    # and in so small a pool the shared prefix's window is evicted before p0 can hit it.
    per_req = -(-window // block_size) + 1
    check_against_hf(windowed[window], window, block_size, mode, n=600, max_tokens=600,
                     num_kv_blocks=2 * per_req + 1, hits_expected=mode == "recompute")


@pytest.mark.slow
def test_2000_token_generation_holds_only_the_window(windowed: dict[int, Path]) -> None:
    llm = LLM(model=str(windowed[32]), block_size=16, max_model_len=2100)
    (out,) = run_checked(llm, make_prompts(40, 20)[:1], 2000, 32, 16)
    assert len(out) == 2000 and llm.kv_stats()["window_freed_blocks"] >= (2040 - 32) // 16 - 1


@pytest.mark.slow
def test_qwen2_mixing_full_and_windowed_layers_matches_hf(make_model: Any) -> None:
    path = make_model("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1,
                      num_hidden_layers=3)
    llm = LLM(model=str(path), block_size=4, max_model_len=512)
    cfg = llm.engine.config.model
    assert cfg.sliding_window == 16 and cfg.full_attention_layers == (0,)
    assert llm.engine.kv.sliding_window is None  # layer 0 needs every block
    prompt = make_prompts(120, 60)[0]
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert list(out.outputs[0].token_ids) == hf_greedy(path, prompt, 80)
    assert llm.kv_stats()["window_freed_blocks"] == 0
