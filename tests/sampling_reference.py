"""An independent per-request reference for sampling through the engine: HF's logits processors
(``RepetitionPenaltyLogitsProcessor``, ``TemperatureLogitsWarper``, ``TopKLogitsWarper``,
``TopPLogitsWarper``, ``MinPLogitsWarper``) on HF's logits of the same weights, and the OpenAI
presence / frequency formula on the output counts. Used by the engine and the server tests.

Token for token: the engine draws a token as argmax(p / E), E ~ Exp(1), and a request with a
``seed`` takes E from its own ``torch.Generator(seed)``, V values per sampled token (see
``layers/sampler.py``). ``race_mismatch`` replays that draw on the reference's p, so every token of
a seeded request is checked; ``first_token_counts`` checks the distribution with no assumption
about how the engine draws.

Processing order is the engine's (and vLLM's): penalties, temperature, top-k, top-p. min-p
commutes with top-k (both keep the best token and min-p's cut is a ratio to it), so no config
below combines min-p with top-p, where the two orders differ.
"""

from __future__ import annotations

import math
from typing import Any

import torch

# Per-row settings of one mixed batch: every sampling option, several per row.
CONFIGS: dict[str, dict[str, Any]] = {
    "top_k": dict(temperature=0.7, top_k=5),
    "top_p": dict(temperature=1.3, top_p=0.6),
    "min_p": dict(temperature=1.0, min_p=0.2),
    "k_p_repetition": dict(temperature=0.9, top_k=20, top_p=0.85, repetition_penalty=1.3),
    "k_min_p": dict(temperature=1.5, top_k=8, min_p=0.2),
    "penalties_k": dict(temperature=1.0, top_k=3, presence_penalty=1.5, frequency_penalty=0.5),
    "greedy_repetition": dict(temperature=0.0, repetition_penalty=1.2),
}


def reference_probs(logits: torch.Tensor, prompt: list[int], output: list[int],
                    cfg: dict[str, Any]) -> torch.Tensor:
    """The distribution the next token must be drawn from: fp32 logits [V] of the position
    after ``prompt + output`` -> probabilities [V] (one-hot for a greedy row)."""
    from transformers import (
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    ids = torch.tensor([prompt + output])
    scores = logits.float().clone().unsqueeze(0)  # [1, V]
    if cfg.get("repetition_penalty", 1.0) != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(cfg["repetition_penalty"])(ids, scores)
    counts = torch.bincount(torch.tensor(output, dtype=torch.long),
                            minlength=scores.shape[-1]).float()
    scores = (scores - cfg.get("frequency_penalty", 0.0) * counts
              - cfg.get("presence_penalty", 0.0) * (counts > 0).float())
    if cfg.get("temperature", 1.0) == 0.0:
        return torch.nn.functional.one_hot(scores.argmax(-1), scores.shape[-1])[0].float()
    scores = TemperatureLogitsWarper(cfg.get("temperature", 1.0))(ids, scores)
    if cfg.get("top_k", 0) > 0:
        scores = TopKLogitsWarper(cfg["top_k"])(ids, scores)
    if cfg.get("top_p", 1.0) < 1.0:
        scores = TopPLogitsWarper(cfg["top_p"])(ids, scores)
    if cfg.get("min_p", 0.0) > 0.0:
        scores = MinPLogitsWarper(cfg["min_p"])(ids, scores)
    return scores.softmax(-1)[0]


def tv_bound(probs: torch.Tensor, n: int, delta: float = 1e-6) -> float:
    """A bound the total-variation distance between ``probs`` and the empirical distribution of
    ``n`` independent draws from it exceeds with probability below ``delta``:
    E[TV] <= 1/2 sum_i sqrt(p_i (1 - p_i) / n) (Jensen, per token), and TV moves by at most 1/n
    when one draw changes, so McDiarmid adds sqrt(ln(1 / delta) / (2 n))."""
    p = probs.double()
    mean = 0.5 * float(torch.sqrt(p * (1 - p) / n).sum())
    return mean + math.sqrt(math.log(1 / delta) / (2 * n))


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts.double() / counts.sum() - probs.double()).abs().sum())


def check_support(model: Any, prompt: list[int], output: list[int], cfg: dict[str, Any]) -> None:
    """Teacher-forced on ``output``: every generated token had non-zero reference probability
    given the prompt and the tokens before it (penalties counted over those tokens)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:].float()
    for i, tok in enumerate(output):
        p = reference_probs(logits[i], prompt, output[:i], cfg)
        assert p[tok] > 0, (f"step {i}: token {tok} is outside the reference's support "
                            f"({int((p > 0).sum())} tokens) for {cfg}")


PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6]  # repeats: the repetition penalty has prompt tokens
SEEDS = [12, 13]  # together, every option of every row decides some token
NUM_TOKENS = 16


def race_mismatch(model: Any, cfg: dict[str, Any], seed: int, tokens: list[int],
                  prompt: list[int] = PROMPT) -> int | None:
    """Teacher-forced on ``tokens``: the first step whose reference draw differs from the token
    there, or None when every token is the one a request with ``cfg`` and ``seed`` must produce
    (greedy rows: the argmax). One forward over the whole sequence."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
    for i, tok in enumerate(tokens):
        p = reference_probs(logits[i], prompt, tokens[:i], cfg)
        if cfg.get("temperature", 1.0) == 0.0:
            want = int(p.argmax())
        else:
            want = int((p / torch.empty_like(p).exponential_(generator=gen)).argmax())
        if want != tok:
            return i
    return None


def without(cfg: dict[str, Any], option: str) -> dict[str, Any]:
    """``cfg`` with one option dropped (temperature: 1.0, or 0.7 where it was 1.0)."""
    if option == "temperature":
        return {**cfg, "temperature": 0.7 if cfg["temperature"] == 1.0 else 1.0}
    return {k: v for k, v in cfg.items() if k != option}


def first_token_counts(llm: Any, n: int) -> dict[str, torch.Tensor]:
    """Config name -> counts [V] of the first token over ``n`` seeded requests per config, all
    configs interleaved in one ``generate`` call (one mixed batch)."""
    from pagedllm import SamplingParams

    keys = [(name, i) for i in range(n) for name in CONFIGS]
    params = [SamplingParams(max_tokens=1, seed=1000 + i, **CONFIGS[name]) for name, i in keys]
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * len(keys), params, use_tqdm=False)
    assert len(outs) == len(keys)
    vocab = llm.engine.config.model.vocab_size
    counts = {name: torch.zeros(vocab, dtype=torch.long) for name in CONFIGS}
    for (name, _), out in zip(keys, outs, strict=True):
        counts[name][out.outputs[0].token_ids[0]] += 1
    return counts
