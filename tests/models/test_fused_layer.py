"""The decoder layer's two-op path (``torch.ops.pagedllm.attn_in`` / ``attn_out_mlp``,
kernels/csrc/decoder_layer.cpp) against its modules called one by one: the same ops in the same
order, so hidden states and the K/V written are bit-identical in fp32, bf16 and fp16, with
packed (oneDNN) and plain linears, on a mixed prefill + decode step and on one-row steps (the
gemv rule). And the cases it does not cover fall back to the modules."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pagedllm import kernels
from pagedllm.attention import AttentionMetadata
from pagedllm.attention.cpu import CpuBackend
from pagedllm.attention.quant import QuantizedKV
from pagedllm.attention.torch_ref import TorchRefBackend
from pagedllm.config import ModelConfig
from pagedllm.layers.linear import onednn_dtypes, pack_linears
from pagedllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from pagedllm.models.loader import load_model

BLOCK = 4


@pytest.fixture(autouse=True)
def _kernels() -> None:
    if os.environ.get("PAGEDLLM_CPU_KERNELS") == "0":
        pytest.skip("CPU kernels switched off by PAGEDLLM_CPU_KERNELS=0")
    assert kernels.available(), f"CPU kernels did not build: {kernels.unavailable_reason()}"


def _meta(reqs: list[tuple[int, int]]) -> AttentionMetadata:
    """reqs = [(cached_len, query_len)]; request i owns blocks i*8 .. i*8+7 (in reverse)."""
    tables = torch.tensor([[i * 8 + 7 - j for j in range(8)] for i in range(len(reqs))],
                          dtype=torch.int32)
    slots = [int(tables[i, p // BLOCK]) * BLOCK + p % BLOCK
             for i, (c, n) in enumerate(reqs) for p in range(c, c + n)]
    qsl = [0]
    for _, n in reqs:
        qsl.append(qsl[-1] + n)
    lens = [c + n for c, n in reqs]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables,
        max_query_len=max(n for _, n in reqs), max_seq_len=max(lens), query_start_loc_cpu=qsl,
        seq_lens_cpu=lens)


def _model(path: Path, dtype: torch.dtype, packed: bool, backend: object = None) -> LlamaForCausalLM:
    cfg = ModelConfig.from_hf(str(path), dtype=str(dtype).removeprefix("torch."))
    model = load_model(cfg, backend or CpuBackend(), "cpu")
    if packed:
        assert pack_linears(model) > 0
    return model  # type: ignore[return-value]


def _run(model: LlamaForCausalLM, reqs: list[tuple[int, int]], fused_layer: bool,
         seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The model's hidden states for a step over random cached K/V, and the caches after it."""
    cfg = model.config
    kernels.set_fused_ops(model, fused_layer, "fused_layer")
    g = torch.Generator().manual_seed(seed)
    dtype = model.model.embed_tokens.weight.dtype
    shape = (8 * len(reqs), BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    caches = [(torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
              for _ in range(cfg.num_hidden_layers)]
    t = sum(n for _, n in reqs)
    ids = torch.randint(0, cfg.vocab_size, (t,), generator=g)
    pos = torch.tensor([p for c, n in reqs for p in range(c, c + n)])
    with torch.inference_mode():
        hidden = model(ids, pos, caches, _meta(reqs))
    return hidden, [c for kv in caches for c in kv]


def _assert_same_as_modules(model: LlamaForCausalLM, reqs: list[tuple[int, int]]) -> None:
    calls = []
    real = LlamaDecoderLayer._forward_ops
    LlamaDecoderLayer._forward_ops = lambda self, *a: calls.append(1) or real(self, *a)  # type: ignore[method-assign]
    try:
        h_ops, kv_ops = _run(model, reqs, True)
    finally:
        LlamaDecoderLayer._forward_ops = real  # type: ignore[method-assign]
    assert len(calls) == model.config.num_hidden_layers  # every layer took the two ops
    h_mod, kv_mod = _run(model, reqs, False)
    assert torch.equal(h_ops, h_mod)
    assert all(torch.equal(a, b) for a, b in zip(kv_ops, kv_mod, strict=True))


MIXED = [(5, 3), (0, 6), (9, 1), (2, 1)]  # prefill chunks after a prefix, fresh, two decodes
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])  # biases, tied, MQA + window
def test_two_ops_equal_the_modules(tiny_models: dict, arch: str, dtype: torch.dtype,
                                   packed: bool) -> None:
    if packed and dtype not in onednn_dtypes():
        pytest.skip(f"oneDNN does not run {dtype} here")
    model = _model(tiny_models[arch], dtype, packed)
    _assert_same_as_modules(model, MIXED)
    _assert_same_as_modules(model, [(7, 1)])  # one row: the small layers' gemv path


def test_fallbacks_run_the_modules(tiny_models: dict) -> None:
    """Quantized KV, a backend without ``attend``, the switch off, autograd on: the modules."""
    model = _model(tiny_models["llama"], torch.float32, True)
    calls = []
    real = LlamaDecoderLayer._forward_ops
    LlamaDecoderLayer._forward_ops = lambda self, *a: calls.append(1) or real(self, *a)  # type: ignore[method-assign]
    try:
        _run(model, MIXED, False)
        kernels.set_fused_ops(model, True, "fused_layer")
        cfg, meta = model.config, _meta(MIXED)
        shape = (8 * len(MIXED), BLOCK, cfg.num_key_value_heads, cfg.head_dim)
        quant = [(QuantizedKV(torch.zeros(shape, dtype=torch.int8),
                              torch.ones(shape[:-1], dtype=torch.bfloat16)), torch.zeros(shape))
                 for _ in range(cfg.num_hidden_layers)]
        ids, pos = torch.zeros(meta.num_tokens, dtype=torch.long), torch.arange(meta.num_tokens)
        with torch.inference_mode():
            model(ids, pos, quant, meta)  # type: ignore[arg-type]
        ref = _model(tiny_models["llama"], torch.float32, True, TorchRefBackend())
        assert all(layer.attend is None for layer in ref.model.layers)
        _run(ref, MIXED, True)
        assert calls == []
    finally:
        LlamaDecoderLayer._forward_ops = real  # type: ignore[method-assign]


def test_engine_switch(tiny_models: dict) -> None:
    """fused_layers=False (--no-fused-layers) and on: the same greedy tokens."""
    from pagedllm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = []
    for on in (False, True):
        llm = LLM(model=str(tiny_models["llama"]), fused_layers=on, num_kv_blocks=64)
        layers = llm.engine.runner.model.model.layers  # type: ignore[attr-defined]
        assert all(layer.fused_layer == on for layer in layers)
        tokens.append([o.outputs[0].token_ids for o in llm.generate(["a b c", "d e"], params)])
    assert tokens[0] == tokens[1]


def test_qk_norm_models_run_the_modules(tiny_models: dict) -> None:
    """attn_in has no q/k norms: a Qwen3 never takes the two ops, even with them switched on."""
    model = _model(tiny_models["qwen3"], torch.float32, True)
    assert model.config.qk_norm and all(layer.attend is None for layer in model.model.layers)
    calls = []
    real = LlamaDecoderLayer._forward_ops
    LlamaDecoderLayer._forward_ops = lambda self, *a: calls.append(1) or real(self, *a)  # type: ignore[method-assign]
    try:
        _run(model, MIXED, True)
    finally:
        LlamaDecoderLayer._forward_ops = real  # type: ignore[method-assign]
    assert calls == []
