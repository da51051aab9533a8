"""The fused CPU elementwise ops (pagedllm/kernels/csrc/elementwise.cpp) against the unfused
torch ops they replace: RMSNorm (+ residual add), rotary, SiLU-and-mul. Rotary and the residual
add are bit-exact; RMSNorm (sum order) and SiLU (exp) are within a few ulp of fp32, and in
bf16/fp16 round at the same points as the torch ops."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from pagedllm import kernels
from pagedllm.layers import RMSNorm, RotaryEmbedding, SiluAndMul
from pagedllm.layers.rotary import apply_rotary, apply_rotary_qk

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# |fused - unfused| <= ULPS x eps x |value| (fp32: sum order, exp; bf16 / fp16: the fp32
# difference may flip the rounding of the normed value, two ulps after the weight multiply),
# or below 1e-30 (SiLU far below -88: both are 0 within 1e-36)
ULPS = {torch.float32: 8, torch.bfloat16: 2, torch.float16: 2}


@pytest.fixture(autouse=True)
def _kernels() -> None:
    """Fail, not skip, when the kernels do not build (unless switched off on purpose)."""
    if os.environ.get("PAGEDLLM_CPU_KERNELS") == "0":
        pytest.skip("CPU kernels switched off by PAGEDLLM_CPU_KERNELS=0")
    assert kernels.available(), f"CPU kernels did not build: {kernels.unavailable_reason()}"


def assert_ulps(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    assert a.dtype == b.dtype == dtype and a.shape == b.shape
    spacing = torch.finfo(dtype).eps * b.float().abs()
    err = (a.float() - b.float()).abs()
    assert (err <= torch.clamp_min(ULPS[dtype] * spacing, 1e-30)).all(), (err / spacing).max()


def _rows(t: int, h: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[t, h] rows with a padded row stride (a slice of a wider tensor), like a fused output."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, h + 24, generator=g) * 3).to(dtype)[:, 5:5 + h]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h", [(1, 256), (7, 100), (600, 768)])  # 600 x 768: split over threads
def test_rms_norm_and_add_norm(dtype: torch.dtype, t: int, h: int) -> None:
    norm = RMSNorm(h, eps=1e-5).to(dtype)
    with torch.inference_mode():
        norm.weight.copy_(torch.randn(h, generator=torch.Generator().manual_seed(1)))
        x, r = _rows(t, h, dtype, 2), _rows(t, h, dtype, 3)
        assert_ulps(norm(x), norm._norm(x), dtype)
        want_sum = x + r
        want = norm._norm(want_sum)
        x2, r2 = x.clone(), r.clone()
        out, total = norm.add_norm(x2, r2)
        assert torch.equal(total, want_sum)  # the residual sum is exact
        assert_ulps(out, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 64, 80, 128])
def test_rotary_in_place_is_bit_exact(dtype: torch.dtype, head_dim: int) -> None:
    t, hq, hk = 37, 12, 4
    rope = RotaryEmbedding(head_dim, 1024, 10000.0)
    pos = torch.randint(0, 1024, (t,), generator=torch.Generator().manual_seed(4))
    cos, sin = rope(pos)
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(t, (hq + 2 * hk) * head_dim, generator=g).to(dtype)
    q = qkv[:, : hq * head_dim].view(t, hq, head_dim)  # strided views, as in the model
    k = qkv[:, hq * head_dim : (hq + hk) * head_dim].view(t, hk, head_dim)
    want_q, want_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    v_before = qkv[:, (hq + hk) * head_dim :].clone()
    with torch.inference_mode():
        got_q, got_k = apply_rotary_qk(q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(qkv[:, (hq + hk) * head_dim :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,i", [(3, 640), (5, 100), (600, 512)])  # 100: a tail past 16 lanes
def test_silu_and_mul(dtype: torch.dtype, t: int, i: int) -> None:
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(t, 2 * i, generator=g) * 4).to(dtype)
    x[0, :8] = torch.tensor([-100.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 100.0, -87.5]).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    want = F.silu(gate) * up
    with torch.inference_mode():
        got = SiluAndMul()(x)
    assert torch.isfinite(got).all()
    assert_ulps(got, want, dtype)


def test_silu_and_mul_vector_lanes_give_the_scalar_loops_bits() -> None:
    """The vector loop (16 lanes on AVX-512, 8 on AVX2) and the scalar tail compute the same exp
    in the same order: the same values give the same bits in rows of 16 (vector) and of 1 (tail
    only). Under PAGEDLLM_ISA=avx2 (test_isa.py) this checks the AVX2 lanes."""
    g = torch.Generator().manual_seed(7)
    vals = torch.cat([torch.randn(240, generator=g) * 6,
                      torch.tensor([-100.0, -87.5, -30.0, -1e-3, 0.0, 1e-3, 30.0, 100.0] * 2)])
    up = torch.randn(256, generator=g)
    wide = torch.cat([vals.view(16, 16), up.view(16, 16)], dim=1)   # [16, 32]: vector lanes
    narrow = torch.stack([vals, up], dim=1)                         # [256, 2]: scalar tail only
    with torch.inference_mode():
        a = torch.ops.pagedllm.silu_and_mul(wide).reshape(-1)
        b = torch.ops.pagedllm.silu_and_mul(narrow).reshape(-1)
    assert torch.equal(a, b)


def test_autograd_takes_the_torch_ops() -> None:
    """The fused ops have no backward: with grad enabled the layers run the torch ops."""
    norm = RMSNorm(64)
    x = torch.randn(4, 64, requires_grad=True)
    y = norm(x)
    assert y.grad_fn is not None
    y.sum().backward()
    assert x.grad is not None and norm.weight.grad is not None


def test_engine_switch_runs_the_torch_ops(tiny_models: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """fused_ops=False (--no-fused-ops) keeps every layer off the fused ops; same greedy tokens."""
    from pagedllm import LLM, SamplingParams

    calls: list[int] = []
    real = kernels.fused
    monkeypatch.setattr(kernels, "fused", lambda *t: calls.append(1) or real(*t))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for on in (False, True):
        calls.clear()
        llm = LLM(model=str(tiny_models["llama"]), fused_ops=on, num_kv_blocks=64)
        tokens[on] = [o.outputs[0].token_ids for o in llm.generate(["a b c", "d e"], params)]
        assert bool(calls) == on
    assert tokens[False] == tokens[True]
