"""Linear layers packed for oneDNN compute what F.linear computes, for every layer kind the
models build (plain, fused q|k|v and gate|up, row-parallel, tied LM head), and fall back to
F.linear where oneDNN cannot run the weight."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pagedllm.distributed.group import TPGroup
from pagedllm.layers.linear import (
    Linear,
    MergedLinear,
    RowParallelLinear,
    gemm_dtypes,
    gemm_runs,
    onednn_dtypes,
    pack_linears,
)

needs_onednn = pytest.mark.skipif(torch.float32 not in onednn_dtypes(),
                                  reason="this torch build has no oneDNN (mkldnn)")
DTYPES = [pytest.param(torch.float32, marks=needs_onednn),
          pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
              torch.bfloat16 not in onednn_dtypes(), reason="no bf16 oneDNN on this CPU"))]
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


class SumGroup:
    """A process group of one: all-reduce is the identity, as it is for a single rank."""

    def allreduce(self, xs: list[torch.Tensor]) -> Any:
        class Done:
            def wait(self) -> None: ...

        return Done()


def _init(m: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    for p in m.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return m


def _layers(dtype: torch.dtype) -> dict[str, nn.Module]:
    tp = TPGroup(0, 1, SumGroup())
    kinds: dict[str, nn.Module] = {
        "plain": Linear(48, 40, bias=False),
        "plain_bias": Linear(48, 40, bias=True),
        "qkv": MergedLinear(48, [32, 16, 16], bias=True),
        "gate_up": MergedLinear(48, [64, 64], bias=False),
        "row_parallel": RowParallelLinear(48, 40, bias=True, tp=tp),
        "lm_head": Linear(48, 300, bias=False),
    }
    return {k: _init(m, i).to(dtype) for i, (k, m) in enumerate(kinds.items())}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 16, 67])
@pytest.mark.parametrize("backend", ["onednn", "gemm"])
def test_packed_equals_f_linear(dtype: torch.dtype, rows: int, backend: str) -> None:
    for kind, m in _layers(dtype).items():
        w = m.weight.detach().clone()
        b = None if m.bias is None else m.bias.detach().clone()
        x = torch.randn(rows, 48).to(dtype)
        want = F.linear(x.float(), w.float(), None if b is None else b.float())
        # pagedllm's GEMM takes weights of a width that is a multiple of 32 (qkv, gate_up), in
        # fp32 and, on CPUs with AVX512-BF16, bf16
        gemm = w.shape[0] % 32 == 0 and w.dtype in gemm_dtypes()
        assert gemm_runs(w) == gemm, kind
        with torch.inference_mode():
            plain = m(x)
            if backend == "gemm" and not gemm:
                assert not m.pack(backend="gemm") and m.packed is None and m.kind == "torch", kind
                continue
            assert m.pack(backend=backend), kind
            got = m(x)
        assert m.kind == backend, kind
        # small fp32 layers on oneDNN keep their weight for one-row calls
        gemv = dtype == torch.float32 and backend == "onednn"
        assert m.packed is not None and m.gemv == gemv, kind
        assert m.weight.numel() == (w.numel() if gemv else 0), kind
        assert got.dtype == dtype and got.shape == (rows, w.shape[0]), kind
        torch.testing.assert_close(got.float(), want, **TOL[dtype], msg=kind)
        torch.testing.assert_close(got, plain, **TOL[dtype], msg=kind)


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_weights_are_held_once(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pagedllm.layers.linear.GEMV_MAX_ELEMENTS", 1000)  # 48 x 40 is large now
    for kind, m in _layers(dtype).items():
        w = m.weight.detach().clone()
        x = torch.randn(1, 48).to(dtype)  # one row: oneDNN too, the plain weight is gone
        m.pack(backend="onednn")
        assert not m.gemv and m.weight.shape == (0, 48) and m.weight.dtype == dtype, kind
        with torch.inference_mode():
            torch.testing.assert_close(m.matmul(x, None).float(), x.float() @ w.float().T,
                                       **TOL[dtype], msg=kind)


@needs_onednn
def test_packed_takes_batched_and_strided_inputs() -> None:
    m = _init(MergedLinear(48, [32, 16, 16], bias=True), 0)
    w, b = m.weight.detach().clone(), m.bias.detach().clone()
    m.pack()
    assert m.kind == ("gemm" if gemm_runs(w) else "onednn")
    x = torch.randn(2, 5, 96)[..., ::2]  # [2, 5, 48], not contiguous
    with torch.inference_mode():
        torch.testing.assert_close(m(x), F.linear(x, w, b), atol=1e-5, rtol=1e-5)


@needs_onednn
def test_tied_lm_head_packs_a_copy_and_the_embedding_keeps_its_weight(
        monkeypatch: pytest.MonkeyPatch) -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(300, 48)
            self.proj = Linear(48, 48, bias=False)
            self.lm_head = Linear(48, 300, bias=False)
            self.lm_head.weight = self.embed.weight

    model = _init(Tied(), 0)
    emb = model.embed.weight.detach().clone()
    proj = model.proj.weight.detach().clone()
    monkeypatch.setattr("pagedllm.layers.linear.GEMV_MAX_ELEMENTS", 1000)  # both are large
    assert pack_linears(model, "onednn") == 2
    assert model.lm_head.weight is model.embed.weight and torch.equal(model.embed.weight, emb)
    assert model.proj.weight.numel() == 0  # untied: the packed copy replaces it
    ids = torch.tensor([3, 299, 0])
    with torch.inference_mode():
        h = model.embed(ids)  # 3 rows: oneDNN
        torch.testing.assert_close(model.embed(ids), emb[ids])
        torch.testing.assert_close(model.lm_head(h), h @ emb.T, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model.proj(h), h @ proj.T, atol=1e-5, rtol=1e-5)


def test_falls_back_to_f_linear_where_onednn_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    half = _init(Linear(16, 8, bias=True), 0).half()  # no oneDNN half path on CPU here
    assert not half.pack() and half.packed is None and half.weight.numel() == 16 * 8
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    m = _init(Linear(16, 8, bias=True), 1)
    x = torch.randn(4, 16)
    assert onednn_dtypes() == () and not m.pack() and pack_linears(m) == 0
    torch.testing.assert_close(m(x), F.linear(x, m.weight, m.bias))


@pytest.mark.parametrize("caps", [(torch.float32,), ()])
def test_bf16_takes_onednn_where_the_gemm_does_not_run(caps: tuple[torch.dtype, ...],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU without AVX512-BF16 (caps: fp32 only) or no kernels at all (none): bf16 layers
    pack for oneDNN under "auto", "gemm" leaves them on F.linear, and both compute the same."""
    monkeypatch.setattr("pagedllm.layers.linear.gemm_dtypes", lambda: caps)
    for kind, m in _layers(torch.bfloat16).items():
        x = torch.randn(5, 48).bfloat16()
        with torch.inference_mode():
            want = m(x)
            assert not gemm_runs(m.weight) and not m.pack(backend="gemm") and m.packed is None
            if torch.bfloat16 in onednn_dtypes():
                assert m.pack() and m.kind == "onednn", kind
            torch.testing.assert_close(m(x), want, **TOL[torch.bfloat16], msg=kind)


@pytest.mark.parametrize("amx", [True, False])
def test_auto_packs_bf16_for_onednn_on_an_amx_cpu(amx: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """With AMX-BF16, oneDNN's tiles beat the GEMM's vdpbf16ps (0.65x in the engine), so "auto"
    packs bf16 for oneDNN there; without it, for the GEMM where the GEMM runs bf16; "gemm" asks
    for the GEMM either way, and fp32 is not affected."""
    from pagedllm import kernels

    if torch.bfloat16 not in onednn_dtypes() or not kernels.available():
        pytest.skip("no bf16 oneDNN or no kernels on this CPU")
    flags = kernels.cpu_flags() | {"amx_bf16"} if amx else kernels.cpu_flags() - {"amx_bf16"}
    monkeypatch.setattr(kernels, "cpu_flags", lambda: flags)
    bf16_gemm = torch.bfloat16 in gemm_dtypes()
    want = {torch.bfloat16: "gemm" if bf16_gemm and not amx else "onednn",
            torch.float32: "gemm" if torch.float32 in gemm_dtypes() else "onednn"}
    for dtype, kind in want.items():
        m = Linear(64, 32, bias=False).to(dtype)
        assert m.pack() and m.kind == kind, (dtype, m.kind)
    if bf16_gemm:
        g = Linear(64, 32, bias=False).to(torch.bfloat16)
        assert g.pack(backend="gemm") and g.kind == "gemm"


def test_no_kernels_no_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pagedllm.kernels.available", lambda: False)
    assert gemm_dtypes() == ()


@needs_onednn
def test_engine_tokens_and_logprobs_same_with_and_without_onednn(tiny_models: dict[str, Any]) -> None:
    from pagedllm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 9, 14, 3, 7][: n + 2]} for n in range(4)]
    outs = {}
    for backend in ("auto", "onednn", "torch"):
        llm = LLM(model=str(tiny_models["qwen2"]), linear_backend=backend, num_kv_blocks=64)
        linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
        assert sum(m.packed is not None for m in linears) == (0 if backend == "torch" else 4 * 2 + 1)  # 4 a layer + lm_head
        if backend == "auto" and gemm_runs(torch.empty(32, 1)):  # every width is a multiple of 32
            assert {m.kind for m in linears} == {"gemm"}
        outs[backend] = llm.generate(prompts, params)
    for packed in ("auto", "onednn"):
        for a, b in zip(outs[packed], outs["torch"]):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                assert la.keys() == lb.keys()
                assert all(abs(la[t].logprob - lb[t].logprob) < 1e-4 for t in la)


@pytest.mark.skipif(torch.bfloat16 not in onednn_dtypes(), reason="no bf16 oneDNN on this CPU")
def test_engine_bf16_on_the_gemm_agrees_with_onednn(tiny_models: dict[str, Any]) -> None:
    """bf16 on pagedllm's GEMM (where the CPU has AVX512-BF16) and on oneDNN: two summation
    orders of the same bf16 products, so not bit-identical, but the greedy tokens and their
    logprobs agree within bf16's rounding on this model."""
    from pagedllm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 9, 14, 3, 7][: n + 2]} for n in range(4)]
    outs = {}
    gemm = "gemm" if torch.bfloat16 in gemm_dtypes() else "onednn"
    for backend in (gemm, "onednn"):
        llm = LLM(model=str(tiny_models["qwen2"]), dtype="bfloat16", linear_backend=backend,
                  num_kv_blocks=64)
        kinds = {m.kind for m in llm.engine.runner.model.modules() if isinstance(m, Linear)}
        assert kinds == {backend}
        outs[backend] = llm.generate(prompts, params)
    for a, b in zip(outs[gemm], outs["onednn"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for t, la, lb in zip(a.outputs[0].token_ids, a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert abs(la[t].logprob - lb[t].logprob) < 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tied_lm_head_on_the_gemm_keeps_the_embedding_weight(dtype: torch.dtype) -> None:
    """A tied LM head packed for pagedllm's GEMM (widths a multiple of 32) is a copy: the
    embedding still reads the plain weight, and the head computes h @ E^T."""
    if dtype not in gemm_dtypes():
        pytest.skip(f"pagedllm's GEMM does not run {dtype} on this CPU")

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(320, 64)
            self.lm_head = Linear(64, 320, bias=False)
            self.lm_head.weight = self.embed.weight

    model = _init(Tied(), 0).to(dtype)
    emb = model.embed.weight.detach().clone()
    assert pack_linears(model, "gemm") == 1 and model.lm_head.kind == "gemm"
    assert model.lm_head.weight is model.embed.weight and torch.equal(model.embed.weight, emb)
    ids = torch.tensor([3, 319, 0])
    with torch.inference_mode():
        h = model.embed(ids)
        torch.testing.assert_close(h, emb[ids])
        want = (h.float() @ emb.float().T).to(dtype)
        torch.testing.assert_close(model.lm_head(h), want, **TOL[dtype])
