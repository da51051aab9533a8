"""Batch-invariant mode (``batch_invariant=True``), end to end and bitwise: one request's tokens,
logprobs (top 3, ranks) and prompt logprobs (top 2) have the same bits run alone, amid 15 or
63 other requests in any position, with its prompt chunked by a small token budget, after a
prefix-cache hit on part of its prompt, and after preemption; in fp32 and bf16, greedy and
seeded. A golden is the request run alone; every float is compared by its bits
(``float.hex``).

The default suite runs each dtype on a few positions, preemption by recompute; ``-m slow`` adds
more positions and preemption by swap.

The model is built to hit what made a request's bits depend on its batch: widths that are not
multiples of 32 (vocab 500, hidden 72, intermediate 200: oneDNN, and F.linear's 1-row GEMV, in
the default mode) and a sliding window of 100 over 250-token prompts (the CPU attention
kernel's tiles started where a chunk's window did). The same checks with the mode off fail
(``test_default_mode_is_not_invariant``). The shipped model's shape (every width a multiple
of 32) runs the two fused decoder-layer ops instead (``test_fused_layer_path``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.outputs import RequestOutput

ODD = dict(vocab_size=500, hidden_size=72, intermediate_size=200, num_attention_heads=6,
           num_key_value_heads=2, head_dim=16, sliding_window=100)
PROMPT_LEN = 250
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3,
                        prompt_logprobs=2)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=8, ignore_eos=True,
                        logprobs=3, prompt_logprobs=2)


@pytest.fixture(scope="module")
def odd_model(make_model: Any) -> Path:
    return make_model("mistral", **ODD)


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(4, vocab) for _ in range(n)]


def signature(out: RequestOutput) -> tuple[Any, ...]:
    """Tokens, then every logprob (with its rank) of the outputs and of the prompt, as bits."""
    comp = out.outputs[0]
    assert comp.logprobs is not None

    def bits(pos: dict[int, Any] | None) -> list[tuple[int, str, int | None]]:
        return [] if pos is None else sorted((t, float(lp.logprob).hex(), lp.rank)
                                             for t, lp in pos.items())

    return (tuple(comp.token_ids), [bits(p) for p in comp.logprobs],
            None if out.prompt_logprobs is None else [bits(p) for p in out.prompt_logprobs])


class Scenarios:
    """Two targets (greedy, seeded) and 62 other requests; each scenario runs the targets in
    a differently made batch and returns their signatures."""

    def __init__(self, path: Path, dtype: str, invariant: bool, vocab: int) -> None:
        rng = random.Random(5)
        self.targets = [_prompt(rng, PROMPT_LEN, vocab), _prompt(rng, PROMPT_LEN - 37, vocab)]
        self.others = [_prompt(rng, rng.randrange(1, 150), vocab) for _ in range(62)]
        self.base = dict(model=str(path), dtype=dtype, batch_invariant=invariant,
                         max_model_len=384, enable_prefix_caching=False)

    def run(self, llm: LLM, batch: list[list[int]], where: list[int],
            params: list[SamplingParams] | None = None,
            targets: tuple[SamplingParams, ...] = (GREEDY, SEEDED)) -> list[RequestOutput]:
        """Generate ``batch`` with the targets inserted at ``where``; the targets' outputs."""
        prompts: list[Any] = [{"prompt_token_ids": p} for p in batch]
        ps: list[SamplingParams] = list(params or [GREEDY] * len(batch))
        for pos, t, sp in sorted(zip(where, self.targets, targets), key=lambda e: e[0]):
            prompts.insert(pos, {"prompt_token_ids": t})
            ps.insert(pos, sp)
        outs = llm.generate(prompts, ps, use_tqdm=False)
        llm.engine.check_integrity()
        return [outs[p] for p in where]

    def alone(self) -> list[tuple[Any, ...]]:
        llm = LLM(**self.base)
        return [signature(llm.generate([{"prompt_token_ids": t}], sp, use_tqdm=False)[0])
                for t, sp in zip(self.targets, (GREEDY, SEEDED))]

    def amid(self, n: int, where: list[int]) -> list[tuple[Any, ...]]:
        llm = LLM(**self.base, max_num_seqs=64)
        return [signature(o) for o in self.run(llm, self.others[: n - 1], where)]

    def chunked(self) -> list[tuple[Any, ...]]:
        llm = LLM(**self.base, max_num_batched_tokens=24)
        return [signature(o) for o in self.run(llm, self.others[:5], [2, 6])]

    def prefix_hit(self) -> list[tuple[Any, ...]]:
        llm = LLM(**{**self.base, "enable_prefix_caching": True})
        # the targets' first 160 tokens (10 blocks) computed by other requests first
        llm.generate([{"prompt_token_ids": t[:160] + o} for t, o in zip(self.targets, self.others)],
                     GREEDY, use_tqdm=False)
        before = llm.engine.prefix_cache_stats()["hits"]
        # a request with prompt logprobs computes its whole prompt: none here
        outs = self.run(llm, [], [0, 1], targets=tuple(p.clone(prompt_logprobs=None) for p in (GREEDY, SEEDED)))
        hits = llm.engine.prefix_cache_stats()["hits"] - before
        assert hits >= 2 * 144, f"meant to hit the cache: {hits} tokens hit"
        return [signature(o) for o in outs]

    def preempted(self, mode: str = "recompute") -> list[tuple[Any, ...]]:
        # 24 blocks of 16 tokens: 8 short requests generating 60 tokens each outgrow the pool,
        # and the targets, which arrive last, are preempted first
        llm = LLM(**self.base, block_size=16, num_kv_blocks=24, max_num_batched_tokens=64,
                  preemption_mode=mode, swap_space=0.01 if mode == "swap" else 0)
        others = [o[:40] for o in self.others[:8]]
        outs = self.run(llm, others, [8, 9], [SamplingParams(max_tokens=60, ignore_eos=True)] * 8)
        assert all(o.metrics.num_preemptions > 0 for o in outs), "meant to be preempted"
        return [signature(o) for o in outs]


def check_invariant(s: Scenarios, quick: bool, only: tuple[str, ...] | None = None) -> None:
    """Each scenario (``only``: those named) against the targets alone, in turn."""
    golden = s.alone()
    runs: dict[str, Callable[[], list[tuple[Any, ...]]]] = {
        "amid 15, positions 0 and 15": lambda: s.amid(16, [0, 15]),
        "amid 63, positions 40 and 3": lambda: s.amid(64, [40, 3]),
        "chunked prefill": s.chunked, "prefix-cache hit": s.prefix_hit,
        "preemption": s.preempted}
    if not quick:
        runs["preemption by swap"] = lambda: s.preempted("swap")
        runs["amid 15, positions 7 and 8"] = lambda: s.amid(16, [7, 8])
        runs["amid 63, positions 63 and 0"] = lambda: s.amid(64, [63, 0])
    for name, run in runs.items():
        if only is not None and name not in only:
            continue
        for which, g, r in zip(("greedy", "seeded"), golden, run()):
            assert r[0] == g[0], f"{which}, {name}: tokens differ from the request alone"
            assert r[1] == g[1], f"{which}, {name}: logprobs differ from the request alone"
            assert r[2] is None or r[2] == g[2], (
                f"{which}, {name}: prompt logprobs differ from the request alone")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bitwise_equal_in_any_batch(odd_model: Path, dtype: str) -> None:
    _skip_unless_gemm(dtype)
    check_invariant(Scenarios(odd_model, dtype, True, ODD["vocab_size"]), quick=True)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bitwise_equal_in_any_batch_more_positions(odd_model: Path, dtype: str) -> None:
    _skip_unless_gemm(dtype)
    check_invariant(Scenarios(odd_model, dtype, True, ODD["vocab_size"]), quick=False)


def test_default_mode_is_not_invariant(odd_model: Path) -> None:
    """The same checks without the mode fail: they can tell."""
    with pytest.raises(AssertionError, match="differ from the request alone"):
        check_invariant(Scenarios(odd_model, "float32", False, ODD["vocab_size"]), quick=True)


def test_fused_layer_path(tiny_models: dict[str, Path]) -> None:
    """Widths that are multiples of 32: the decoder layers run as the two C++ ops."""
    from pagedllm.models.llama import LlamaDecoderLayer

    s = Scenarios(tiny_models["llama"], "float32", True, 512)
    llm = LLM(**s.base)
    assert all(m.fused_layer for m in llm.engine.runner.model.modules()
               if isinstance(m, LlamaDecoderLayer))
    check_invariant(s, quick=True, only=("amid 63, positions 40 and 3", "chunked prefill",
                                         "prefix-cache hit"))


def test_an_odd_width_outside_the_layers_keeps_them_fused(make_model: Any,
                                                         odd_model: Path) -> None:
    """A vocabulary of 500 (the LM head alone) leaves the decoder layers on the two C++ ops;
    the odd model's MLP width (200) sends its layers through their modules."""
    from pagedllm.layers.linear import Linear
    from pagedllm.models.llama import LlamaDecoderLayer

    for path, fused in ((make_model("llama", vocab_size=500), True), (odd_model, False)):
        model = LLM(model=str(path), batch_invariant=True, max_model_len=384).engine.runner.model
        assert all(m.fused_layer is fused for m in model.modules()
                   if isinstance(m, LlamaDecoderLayer))
        assert all(m.kind == "gemm" for m in model.modules() if isinstance(m, Linear))


def _skip_unless_gemm(dtype: str) -> None:
    import torch

    from pagedllm.layers.linear import gemm_dtypes

    if getattr(torch, dtype) not in gemm_dtypes():
        pytest.skip(f"pagedllm's GEMM does not run {dtype} on this CPU")


def _generate(llm: LLM, requests: list[tuple[str, list[int]]],
              params: SamplingParams) -> dict[str, tuple[int, ...]]:
    """Requests added under their own ids, stepped to the end: id -> tokens."""
    for rid, prompt in requests:
        llm.engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    done: dict[str, tuple[int, ...]] = {}
    for _ in range(1000):
        if not llm.engine.has_unfinished_requests():
            break
        for out in llm.engine.step():
            if out.finished:
                done[out.request_id] = tuple(out.outputs[0].token_ids)
    return done


@pytest.mark.parametrize("invariant", [True, False])
def test_unseeded_request_has_its_own_generator(tiny_models: dict[str, Path],
                                                invariant: bool) -> None:
    """In the mode an unseeded request samples from a generator of its own (seeded from the
    engine seed and its id): the same tokens alone or after 15 other sampled requests. Without
    the mode it draws from the engine's generator, after its neighbours' draws."""
    rng = random.Random(9)
    target = ("target", _prompt(rng, 30, 512))
    others = [(f"o{i}", _prompt(rng, rng.randrange(1, 40), 512)) for i in range(15)]
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    base = dict(model=str(tiny_models["llama"]), batch_invariant=invariant)
    alone = _generate(LLM(**base), [target], params)["target"]
    amid = _generate(LLM(**base), [*others[:7], target, *others[7:]], params)["target"]
    assert (amid == alone) is invariant


def test_matches_hf(odd_model: Path) -> None:
    """The mode on the odd-width, windowed model against HF transformers: greedy tokens equal,
    logprobs within 1e-4 (fp32)."""
    rng = random.Random(2)
    prompts = [_prompt(rng, n, ODD["vocab_size"]) for n in (3, 120, PROMPT_LEN)]
    llm = LLM(model=str(odd_model), batch_invariant=True, max_model_len=384,
              max_num_batched_tokens=64)
    assert_matches_hf(odd_model, prompts, llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                       GREEDY, use_tqdm=False))


def assert_matches_hf(path: Path, prompts: list[list[int]], outs: list[RequestOutput]) -> None:
    """Greedy ``outs`` of ``prompts`` against HF transformers on ``path`` in fp32: the same
    tokens, each token's logprob within 1e-4."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for p, out in zip(prompts, outs, strict=True):
        ids = list(out.outputs[0].token_ids)
        with torch.no_grad():
            ref = hf(torch.tensor([p + ids])).logits[0, len(p) - 1 : -1].float().log_softmax(-1)
        assert ids == ref.argmax(-1).tolist()
        assert out.outputs[0].logprobs is not None
        for step, tok in enumerate(ids):
            assert abs(out.outputs[0].logprobs[step][tok].logprob - ref[step, tok].item()) < 1e-4
