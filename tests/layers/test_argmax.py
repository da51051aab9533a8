"""Greedy sampling's argmax: ``torch.ops.pagedllm.argmax_rows`` (kernels/csrc/argmax.cpp) gives
torch.argmax's answer in every dtype, with ties (first index), NaN (first NaN), all -inf rows,
maxima in the vector tail, strided rows and one-thread / threaded splits; and the sampler's
plain-greedy path (model-dtype logits, no fp32 copy) picks what its general path picks."""

from __future__ import annotations

import os

import pytest
import torch

from pagedllm import kernels
from pagedllm.layers.sampler import SamplingMetadata, argmax, plain_greedy, sample


@pytest.fixture
def _kernels() -> None:
    if os.environ.get("PAGEDLLM_CPU_KERNELS") == "0":
        pytest.skip("CPU kernels switched off by PAGEDLLM_CPU_KERNELS=0")
    assert kernels.available(), f"CPU kernels did not build: {kernels.unavailable_reason()}"


def _planted(rows: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """Random rows with planted edge cases: exact ties (in the vector body, across vector lanes,
    in the scalar tail), NaNs, an all -inf row, a maximum in the last position, -0.0 vs 0.0."""
    g = torch.Generator().manual_seed(rows * 1000 + vocab)
    x = torch.randn(rows, vocab, generator=g).to(dtype)
    cases = [
        lambda r: r.__setitem__(slice(None), 0.0),                      # all equal: index 0
        lambda r: (r.__setitem__(vocab // 2, 9.0), r.__setitem__(3, 9.0)),  # tie: first wins
        lambda r: (r.__setitem__(17, 9.0), r.__setitem__(18, 9.0)),     # tie inside one vector
        lambda r: r.__setitem__(vocab - 1, 9.0),                        # in the tail
        lambda r: (r.__setitem__(vocab - 2, 9.0), r.__setitem__(vocab - 1, 9.0)),
        lambda r: (r.__setitem__(5, float("nan")), r.__setitem__(2, float("nan"))),
        lambda r: (r.__setitem__(vocab - 1, float("nan")), r.__setitem__(0, float("inf"))),
        lambda r: r.__setitem__(slice(None), float("-inf")),            # every token banned
        lambda r: (r.__setitem__(slice(None), -1.0), r.__setitem__(4, -0.0), r.__setitem__(6, 0.0)),
        lambda r: r.__setitem__(slice(1, None), float("-inf")),
    ]
    for i, case in enumerate(cases[:rows] if vocab >= 20 else cases[:1]):
        case(x[i])
    return x


@pytest.mark.usefixtures("_kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 15), (10, 16), (12, 33), (16, 4096),
                                        (40, 32000), (2, 50257)])
def test_argmax_rows_equals_torch(dtype: torch.dtype, rows: int, vocab: int) -> None:
    x = _planted(rows, vocab, dtype)
    got = torch.ops.pagedllm.argmax_rows(x)
    assert got.dtype == torch.int64
    assert got.tolist() == x.argmax(-1).tolist()
    assert got.tolist() == x.float().argmax(-1).tolist()  # what sampling fp32 logits picked


@pytest.mark.usefixtures("_kernels")
def test_argmax_rows_strided_rows_threads_and_errors() -> None:
    x = _planted(24, 1100, torch.float32)[:, 50:1090]  # rows with a padded stride
    want = x.argmax(-1).tolist()
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert torch.ops.pagedllm.argmax_rows(x).tolist() == want
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match="contiguous last dim"):
        torch.ops.pagedllm.argmax_rows(torch.randn(8, 4).T)
    with pytest.raises(RuntimeError, match="fp32, bf16 or fp16"):
        torch.ops.pagedllm.argmax_rows(torch.zeros(2, 3, dtype=torch.float64))
    # the wrapper sends what the op refuses to torch
    t = torch.randn(8, 4).T
    assert argmax(t).tolist() == t.argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_plain_greedy_path_picks_what_the_general_path_picks(dtype: torch.dtype) -> None:
    x = _planted(10, 300, dtype)
    md = SamplingMetadata(temperature=torch.zeros(10), all_greedy=True)
    assert plain_greedy(md)
    fast = sample(x, md).token_ids  # model-dtype logits, straight to the argmax
    # the general path: fp32 logits, greedy rows of a mixed batch (the other rows sample)
    temp = torch.tensor([0.0] * 9 + [1.0])
    general = sample(x.float(), SamplingMetadata(temperature=temp, all_greedy=False)).token_ids
    assert fast.tolist()[:9] == general.tolist()[:9] == x.float().argmax(-1).tolist()[:9]
    # with logprobs asked for the same tokens come back through the fp32 path
    with_lps = sample(x, SamplingMetadata(temperature=torch.zeros(10), all_greedy=True,
                                          max_num_logprobs=0))
    assert with_lps.token_ids.tolist() == fast.tolist()


def test_plain_greedy_only_without_anything_that_edits_logits() -> None:
    z = torch.zeros(2)
    base = dict(temperature=z, all_greedy=True)
    assert plain_greedy(SamplingMetadata(**base))
    assert not plain_greedy(SamplingMetadata(temperature=z, all_greedy=False))
    assert not plain_greedy(SamplingMetadata(**base, max_num_logprobs=0))
    assert not plain_greedy(SamplingMetadata(**base, output_counts=torch.zeros(2, 5)))
    ids = torch.tensor([0, 1])
    assert not plain_greedy(SamplingMetadata(**base, banned=(ids, ids)))
    assert not plain_greedy(SamplingMetadata(**base, bias=(ids, ids, z)))
    assert not plain_greedy(SamplingMetadata(**base, token_mask=(ids, torch.zeros(2, 1,
                                                                               dtype=torch.int32))))
    # a ban edits the logits: the banned best token is not chosen
    logits = torch.tensor([[5.0, 1.0, 0.0]])
    md = SamplingMetadata(temperature=torch.zeros(1), all_greedy=True,
                          banned=(torch.tensor([0]), torch.tensor([0])))
    assert sample(logits, md).token_ids.tolist() == [1]
