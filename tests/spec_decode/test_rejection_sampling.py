"""Speculation keeps the target's distribution: a chi-square test of sampled tokens against the
exact probabilities of HF transformers on the same weights (a 16-token vocabulary).

Each request samples 3 tokens at temperature 1 from one prompt: t1 from the prefill (no
speculation), then one decode step that verifies the draft's proposal d for t2 and keeps
row 1's sample as t3 only when row 0's sample equalled d. So t2 is row 0's draw, and t3 is
either row 1's draw (d accepted) or the next step's: the joint law of (t2, t3) is the target's
only if acceptance and the discarding of rows after a rejection are right. Planted bugs fail it:
keeping row a + 1's draw after a mismatch at row a gave chi-square 1178 (64 dof, critical 115,
N = 3000); accepting d unconditionally fails the acceptance-rate check (and the statistic)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm import LLM, SamplingParams

VOCAB = 16
PROMPT = [5, 9, 6, 12, 5, 9, 6, 7]
N = 2000


@pytest.fixture(scope="module")
def small_vocab_model(make_model: Any) -> Path:
    # sharp logits: greedy proposals are often right, so acceptance and rejection are both common
    return make_model("llama", vocab_size=VOCAB, head_dim=32, initializer_range=0.3)


def exact_joint(path: Path) -> torch.Tensor:
    """P(t2 = a, t3 = b) [VOCAB, VOCAB] from HF: sum over t1 of p(t1) p(a | t1) p(b | t1, a)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    v = torch.arange(VOCAB)
    with torch.no_grad():
        p1 = hf(torch.tensor([PROMPT])).logits[0, -1].softmax(-1)  # [V]
        seqs = torch.tensor(PROMPT).repeat(VOCAB * VOCAB, 1)
        seqs = torch.cat([seqs, v.repeat_interleave(VOCAB)[:, None], v.repeat(VOCAB)[:, None]], 1)
        logits = hf(seqs).logits  # [V*V, len+2, V]: rows (t1, t2)
        p2 = logits[::VOCAB, -2].softmax(-1)  # [t1, t2]
        p3 = logits[:, -1].softmax(-1).view(VOCAB, VOCAB, VOCAB)  # [t1, t2, t3]
    return torch.einsum("i,ij,ijk->jk", p1, p2, p3)


def chi_square(counts: torch.Tensor, probs: torch.Tensor, n: int) -> tuple[float, int]:
    """Pearson's statistic with cells of expected count < 5 pooled into one; (stat, dof)."""
    exp, obs = probs.flatten() * n, counts.flatten().double()
    small = exp < 5
    exp = torch.cat([exp[~small], exp[small].sum()[None]])
    obs = torch.cat([obs[~small], obs[small].sum()[None]])
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


def chi2_critical(dof: int, z: float = 3.719) -> float:
    """Upper 1e-4 quantile (z = 3.719) of chi-square(dof), Wilson-Hilferty approximation."""
    c = 2.0 / (9.0 * dof)
    return dof * (1.0 - c + z * math.sqrt(c)) ** 3


@pytest.mark.slow  # ~15 s on an idle machine: 2000 requests through a draft
def test_speculative_sampling_has_the_targets_distribution(small_vocab_model: Path) -> None:
    # the target as its own draft: proposals are its greedy tokens, accepted with p(argmax)
    spec = {"model": str(small_vocab_model), "num_speculative_tokens": 2,
            "min_acceptance_rate": 0.0, "disable_by_batch_size": None}
    llm = LLM(model=str(small_vocab_model), block_size=4, num_kv_blocks=2048, max_model_len=32,
              max_num_seqs=256, speculative_config=spec)
    params = [SamplingParams(temperature=1.0, max_tokens=3, seed=i, ignore_eos=True)
              for i in range(N)]
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * N, params, use_tqdm=False)
    counts = torch.zeros(VOCAB, VOCAB)
    for o in outs:
        t = o.outputs[0].token_ids
        counts[t[1], t[2]] += 1
    s = llm.engine.kv_stats()
    drafted, accepted = s["spec_decode_num_draft_tokens"], s["spec_decode_num_accepted_tokens"]
    # the step under test verified a proposal for nearly every request, accepted often, not always
    assert drafted >= 0.9 * N and 0.2 * drafted < accepted < 0.9 * drafted, (accepted, drafted)
    stat, dof = chi_square(counts, exact_joint(small_vocab_model), N)
    assert dof >= 10
    assert stat < chi2_critical(dof), f"chi-square {stat:.1f} with {dof} dof"
