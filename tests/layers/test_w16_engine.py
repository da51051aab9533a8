"""16-bit weights with float32 compute (layers/linear.py ``w16_dtype``): the choice per CPU, and an
engine that chose it generating what HF's float32 forward generates on the same 16-bit-rounded
linear weights (greedy identical, logprobs within 1e-4). On this machine the choice is forced by
monkeypatching where the CPU has bf16 arithmetic; tests/layers/test_isa.py runs this file on
the AVX2 build, where the engine chooses it itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm import LLM, SamplingParams, kernels
from pagedllm.layers import linear
from pagedllm.layers.linear import Linear

needs_gemm = pytest.mark.skipif(not kernels.available() or torch.float32 not in linear.gemm_dtypes(),
                                reason="pagedllm's float32 GEMM does not run here")


@needs_gemm
def test_w16_dtype_follows_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear, "gemm_dtypes", lambda: (torch.float32,))  # an AVX2 CPU's
    monkeypatch.setattr(kernels, "isa", lambda: "avx2")
    assert linear.w16_dtype("bfloat16", "cpu") == "bfloat16"
    assert linear.w16_dtype("float16", "cpu") == "float16"
    assert linear.w16_dtype("float32", "cpu") is None
    assert linear.w16_dtype("bfloat16", "cuda") is None
    monkeypatch.setattr(linear, "gemm_dtypes", lambda: (torch.float32, torch.bfloat16))
    assert linear.w16_dtype("bfloat16", "cpu") is None  # AVX512-BF16: bf16 arithmetic
    monkeypatch.setattr(linear, "gemm_dtypes", lambda: ())  # no GEMM: no fp32 path to take
    assert linear.w16_dtype("bfloat16", "cpu") is None


def _hf_on_rounded_linears(path: Path, dtype: torch.dtype, prompts: list[list[int]],
                           steps: int) -> list[tuple[list[int], torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.Linear) and name != "lm_head":  # lm_head: tied below
                m.weight.copy_(m.weight.to(dtype).float())
        head = model.get_output_embeddings()
        if head.weight is model.get_input_embeddings().weight:  # tied: the engine packs a copy
            head.weight = torch.nn.Parameter(head.weight.to(dtype).float())
        else:
            head.weight.copy_(head.weight.to(dtype).float())
    res = []
    for p in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=steps, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        res.append((out.sequences[0, len(p):].tolist(), torch.cat(out.logits).float().log_softmax(-1)))
    return res


@needs_gemm
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_engine_with_16bit_weights_matches_hf_on_those_weights(
        tiny_models: dict[str, Any], monkeypatch: pytest.MonkeyPatch, dtype: str) -> None:
    if linear.w16_dtype(dtype, "cpu") is None:  # this CPU has the arithmetic: force the choice
        monkeypatch.setattr(linear, "w16_dtype", lambda d, dev: d if dev == "cpu" else None)
    path = tiny_models["qwen2"]  # tied lm_head: packed as a 16-bit copy, embedding float32
    prompts = [[5, 9, 14, 3, 7, 11][: n + 2] for n in range(4)]
    llm = LLM(model=str(path), dtype=dtype, num_kv_blocks=64)
    mcfg = llm.engine.config.model
    assert (mcfg.dtype, mcfg.weight_dtype) == ("float32", dtype)
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    assert {(m.kind, m.packed.dtype) for m in linears} == {("gemm", getattr(torch, dtype))}
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    want = _hf_on_rounded_linears(path, getattr(torch, dtype), prompts, 10)
    for out, (ids, lps) in zip(outs, want, strict=True):
        assert out.outputs[0].token_ids == ids
        for i, t in enumerate(ids):
            assert abs(out.outputs[0].logprobs[i][t].logprob - lps[i, t].item()) < 1e-4
    llm.engine.check_integrity()
