"""Batch-invariant mode on the Triton kernel family (``attention_backend="triton"``: the GEMM, norm
and softmax of layers/triton_invariant.py, every token through the fixed-split decode kernel),
end to end and bitwise, as tests/golden/test_batch_invariant.py does for the CPU family: one
request's tokens, logprobs and prompt logprobs have the same bits alone, amid other requests,
with its prompt chunked, after a prefix-cache hit and after preemption; and the mode agrees
with HF transformers. In Triton's interpreter on CPU tensors (fp32, and bf16 in the slow suite;
small sizes, since every kernel runs in numpy), on the GPU where there is one
(scripts/gpu_check.sh, step ``invariant``)."""

from __future__ import annotations

from triton_env import DEVICE  # first: sets TRITON_INTERPRET before triton is imported

# isort: split
import random
from pathlib import Path
from typing import Any

import pytest
from test_batch_invariant import ODD, assert_matches_hf, signature

from pagedllm import LLM, SamplingParams
from pagedllm.layers import triton_invariant
from pagedllm.outputs import RequestOutput

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3,
                        prompt_logprobs=2)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=4, ignore_eos=True,
                        logprobs=3, prompt_logprobs=2)
WINDOW = 40  # shorter than the targets' prompts


@pytest.fixture(scope="module")
def model(make_model: Any) -> Path:
    return make_model("mistral", **{**ODD, "sliding_window": WINDOW})


class Small:
    """Two targets (greedy 60 tokens, seeded 45) and 7 other requests; each run returns the
    targets' signatures."""

    def __init__(self, path: Path, invariant: bool = True, dtype: str = "float32") -> None:
        rng = random.Random(5)
        vocab = ODD["vocab_size"]
        self.targets = [[rng.randrange(4, vocab) for _ in range(n)] for n in (60, 45)]
        self.others = [[rng.randrange(4, vocab) for _ in range(rng.randrange(1, 40))]
                       for _ in range(7)]
        self.base = dict(model=str(path), device=DEVICE, attention_backend="triton",
                         batch_invariant=invariant, max_model_len=128, dtype=dtype,
                         enable_prefix_caching=False)

    def llm(self, **kw: Any) -> LLM:
        return LLM(**{**self.base, **kw})

    def run(self, llm: LLM, others: list[list[int]], where: list[int],
            params: list[SamplingParams] | None = None,
            targets: tuple[SamplingParams, ...] = (GREEDY, SEEDED)) -> list[RequestOutput]:
        prompts: list[Any] = [{"prompt_token_ids": p} for p in others]
        ps = list(params or [GREEDY] * len(others))
        for pos, t, sp in sorted(zip(where, self.targets, targets), key=lambda e: e[0]):
            prompts.insert(pos, {"prompt_token_ids": t})
            ps.insert(pos, sp)
        outs = llm.generate(prompts, ps, use_tqdm=False)
        llm.engine.check_integrity()
        assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
        return [outs[p] for p in where]

    def alone(self) -> list[tuple[Any, ...]]:
        llm = self.llm()
        return [signature(llm.generate([{"prompt_token_ids": t}], sp, use_tqdm=False)[0])
                for t, sp in zip(self.targets, (GREEDY, SEEDED))]

    def amid(self) -> list[tuple[Any, ...]]:
        """Decode steps through the CUDA-graph runner's static buffers, padded to a captured
        size (replayed eagerly here; recorded on a GPU)."""
        llm = self.llm(max_num_seqs=12)
        graphs = llm.engine.runner.graphs
        if graphs is None:  # on CPU: the same padded path, not recorded
            graphs = llm.engine.runner.enable_decode_graphs(capture=False)
        outs = self.run(llm, self.others, [0, 5])
        assert graphs.replays > 0
        return [signature(o) for o in outs]

    def chunked(self) -> list[tuple[Any, ...]]:
        llm = self.llm(max_num_batched_tokens=16)
        return [signature(o) for o in self.run(llm, self.others[:2], [1, 3])]

    def prefix_hit(self) -> list[tuple[Any, ...]]:
        llm = self.llm(enable_prefix_caching=True, block_size=16)
        llm.generate([{"prompt_token_ids": t[:32] + o} for t, o in zip(self.targets, self.others)],
                     GREEDY, use_tqdm=False)
        before = llm.engine.prefix_cache_stats()["hits"]
        outs = self.run(llm, [], [0, 1], targets=tuple(p.clone(prompt_logprobs=None)
                                                        for p in (GREEDY, SEEDED)))
        assert llm.engine.prefix_cache_stats()["hits"] - before >= 2 * 32, "meant to hit"
        return [signature(o) for o in outs]

    def preempted(self) -> list[tuple[Any, ...]]:
        # 5 blocks of 16 tokens: three short requests generating 30 tokens each and the targets
        # outgrow the pool (the window frees blocks, but not enough); the targets, which
        # arrive last, are preempted first
        llm = self.llm(block_size=16, num_kv_blocks=5, max_num_batched_tokens=64)
        others = [o[:8] for o in self.others[:3]]
        outs = self.run(llm, others, [3, 4], [SamplingParams(max_tokens=30, ignore_eos=True)] * 3)
        assert all(o.metrics.num_preemptions > 0 for o in outs), "meant to be preempted"
        return [signature(o) for o in outs]


def check(s: Small, names: tuple[str, ...]) -> None:
    golden = s.alone()
    for name in names:
        for which, g, r in zip(("greedy", "seeded"), golden, getattr(s, name)()):
            assert r[0] == g[0], f"{which}, {name}: tokens differ from the request alone"
            assert r[1] == g[1], f"{which}, {name}: logprobs differ from the request alone"
            assert r[2] is None or r[2] == g[2], f"{which}, {name}: prompt logprobs differ"


def test_bitwise_equal_amid_others_and_chunked(model: Path) -> None:
    s = Small(model)
    runner = s.llm().engine.runner
    assert runner.backend.name == "triton" and runner.softmax is triton_invariant.softmax
    check(s, ("amid", "chunked"))


@pytest.mark.slow
def test_bitwise_equal_after_a_prefix_hit_and_preemption(model: Path) -> None:
    check(Small(model), ("prefix_hit", "preempted"))


@pytest.mark.slow
def test_bitwise_equal_in_bfloat16(model: Path) -> None:
    """bf16 weights, activations and KV (the interpreter computes bf16 dots in fp32 and
    rounds by hand where it would truncate; a GPU runs them as they are)."""
    check(Small(model, dtype="bfloat16"), ("amid", "chunked"))


@pytest.mark.slow
def test_default_mode_is_not_invariant(model: Path) -> None:
    with pytest.raises(AssertionError, match="differ"):
        check(Small(model, invariant=False), ("chunked",))


def test_matches_hf(model: Path) -> None:
    """Greedy tokens equal to HF transformers', logprobs within 1e-4 (fp32)."""
    s = Small(model)
    outs = s.llm(max_num_batched_tokens=32).generate(
        [{"prompt_token_ids": p} for p in s.targets], GREEDY, use_tqdm=False)
    assert_matches_hf(model, s.targets, outs)
