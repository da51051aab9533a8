from __future__ import annotations

import pytest
import torch

from pagedllm.layers.sampler import SamplingMetadata, apply_top_k_top_p_min_p, sample
from pagedllm.sampling_params import SamplingParams


def _md(b: int, temp: float = 1.0, **kw) -> SamplingMetadata:  # type: ignore[no-untyped-def]
    return SamplingMetadata(temperature=torch.full((b,), temp), all_greedy=temp == 0.0, **kw)


def test_greedy_is_argmax_and_logprobs_are_raw() -> None:
    logits = torch.randn(4, 50)
    out = sample(logits, _md(4, 0.0, max_num_logprobs=3))
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    ref = logits.log_softmax(-1)
    assert torch.allclose(out.logprobs, ref.max(-1).values)
    assert out.ranks.tolist() == [1, 1, 1, 1]
    assert torch.allclose(out.topk_logprobs, ref.topk(3).values)


def test_top_k_one_is_greedy_and_top_p_tiny_keeps_best() -> None:
    logits = torch.randn(3, 40)
    k1 = sample(logits, _md(3, 1.0, top_k=torch.tensor([1, 1, 1])))
    assert k1.token_ids.tolist() == logits.argmax(-1).tolist()
    p = sample(logits, _md(3, 1.0, top_p=torch.tensor([1e-6] * 3)))
    assert p.token_ids.tolist() == logits.argmax(-1).tolist()


def test_top_k_top_p_min_p_masks() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    md = _md(1, top_k=torch.tensor([3]))
    kept = apply_top_k_top_p_min_p(logits, md).isfinite()
    assert kept.tolist() == [[True, True, True, False]]
    md = _md(1, top_p=torch.tensor([0.7]))  # 0.5 + 0.3 reaches 0.7 -> keep two
    assert apply_top_k_top_p_min_p(logits, md).isfinite().tolist() == [[True, True, False, False]]
    md = _md(1, min_p=torch.tensor([0.5]))  # keep p >= 0.25
    assert apply_top_k_top_p_min_p(logits, md).isfinite().tolist() == [[True, True, False, False]]


def test_sampling_follows_the_distribution() -> None:
    torch.manual_seed(0)
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().expand(20000, 3).clone()
    ids = sample(logits, _md(20000)).token_ids
    freq = torch.bincount(ids, minlength=3).float() / ids.numel()
    assert torch.allclose(freq, probs, atol=0.02)


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    logits = torch.randn(1, 100)

    def run(batch: int, row: int) -> list[int]:
        gen = torch.Generator().manual_seed(7)
        toks = []
        for _ in range(5):
            big = torch.randn(batch, 100)
            big[row] = logits[0]
            toks.append(int(sample(big, _md(batch, generators={row: gen})).token_ids[row]))
        return toks

    assert run(1, 0) == run(6, 3) == run(3, 2)


def test_penalties() -> None:
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5]])
    counts = torch.tensor([[2.0, 0.0, 1.0, 0.0]])
    md = _md(1, 0.0, output_counts=counts, frequency_penalty=torch.tensor([0.5]),
             presence_penalty=torch.tensor([1.0]))
    # token 0: 2 - 0.5*2 - 1 = 0; token 1 stays 1.0 -> greedy picks 1
    assert sample(logits, md).token_ids.tolist() == [1]
    md = _md(1, 0.0, output_counts=counts, repetition_penalty=torch.tensor([4.0]),
             prompt_mask=torch.tensor([[False, False, False, True]]))
    # token 0: 2/4 = 0.5, token 3 (in prompt): 0.5/4; token 1 untouched = 1.0
    assert sample(logits, md).token_ids.tolist() == [1]


def test_banned_tokens() -> None:
    logits = torch.tensor([[5.0, 1.0, 0.0]])
    assert sample(logits, _md(1, 0.0, banned=(torch.tensor([0]), torch.tensor([0])))).token_ids.tolist() == [1]
    logits = torch.tensor([[5.0, 4.0, 0.0], [0.0, 1.0, 9.0]])
    banned = (torch.tensor([0, 0, 1]), torch.tensor([0, 1, 2]))  # row 0: ids 0, 1; row 1: id 2
    assert sample(logits, _md(2, 0.0, banned=banned)).token_ids.tolist() == [2, 1]
    assert logits[0, 0] == 5.0  # the caller's logits are left alone


@pytest.mark.parametrize(
    "field,value",
    [("temperature", -1.0), ("top_p", 0.0), ("top_k", -5), ("min_p", 1.5), ("n", 0),
     ("max_tokens", 0), ("presence_penalty", 3.0), ("repetition_penalty", 0.0),
     ("logprobs", -1), ("stop", [""])],
)
def test_invalid_params_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_must_not_exceed_max_tokens() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=2)
