"""The batch-invariant Triton kernels (layers/triton_invariant.py), one by one: a row's bits do not
depend on the other rows of the call, and each matches torch. In Triton's interpreter on CPU
tensors here (fp32 arithmetic, as numpy runs it); compiled on a GPU where there is one
(scripts/gpu_check.sh, step ``invariant``). The engine-level checks are
tests/golden/test_batch_invariant_triton.py."""

from __future__ import annotations

from triton_env import DEVICE  # first: sets TRITON_INTERPRET before triton is imported

# isort: split
import pytest
import torch

from pagedllm.layers import triton_invariant as ti
from pagedllm.layers.linear import Linear, use_triton_invariant
from pagedllm.layers.rmsnorm import RMSNorm

BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
ATOL = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def _row_by_row(fn: object, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([fn(x[i : i + 1]) for i in range(x.shape[0])])  # type: ignore[operator]


@pytest.mark.parametrize("dtype,n,k,bias", [
    (torch.float32, 200, 72, True), (torch.float32, 500, 72, False), (torch.float32, 7, 33, True),
    (torch.bfloat16, 200, 72, True), (torch.float16, 7, 33, False)])
def test_matmul_row_bits_do_not_depend_on_the_rows(dtype: torch.dtype, n: int, k: int,
                                                   bias: bool) -> None:
    gen = torch.Generator().manual_seed(n + k)
    w, x = _randn(gen, n, k, dtype=dtype), _randn(gen, 70, k, dtype=dtype)
    b = _randn(gen, n, dtype=dtype) if bias else None
    alone = _row_by_row(lambda r: ti.matmul(r, w, b), x).view(BITS[dtype])
    for m in (2, 16, 63, 64, 65, 70):  # under, at and over one tile of rows
        assert torch.equal(ti.matmul(x[:m], w, b).view(BITS[dtype]), alone[:m]), f"{m} rows"
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(ti.matmul(x, w, b).double(), ref, atol=ATOL[dtype] * k ** 0.5,
                               rtol=1e-2 if dtype != torch.float32 else 1e-5)
    assert ti.matmul(x[:0], w, b).shape == (0, n)


def test_matmul_refuses_mixed_dtypes() -> None:
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(AssertionError):
        ti.matmul(x, torch.zeros(4, 8, dtype=torch.float16, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [72, 128])
def test_rms_norm_matches_torch_row_by_row(dtype: torch.dtype, hidden: int) -> None:
    gen = torch.Generator().manual_seed(hidden)
    norm = RMSNorm(hidden, 1e-5).to(dtype).to(DEVICE)
    norm.fused = False
    with torch.no_grad():
        norm.weight.copy_(_randn(gen, hidden, dtype=dtype))
    x, res = _randn(gen, 37, hidden, dtype=dtype), _randn(gen, 37, hidden, dtype=dtype)
    got = ti.rms_norm(x, norm.weight, norm.eps)
    torch.testing.assert_close(got, norm._norm(x), atol=ATOL[dtype], rtol=1e-2)
    alone = _row_by_row(lambda r: ti.rms_norm(r, norm.weight, norm.eps), x)
    assert torch.equal(got.view(BITS[dtype]), alone.view(BITS[dtype]))
    with torch.no_grad():
        want_y, want_res = norm.add_norm(x.clone(), res.clone())
    xi, ri = x.clone(), res.clone()
    ti.add_rms_norm_(xi, ri, norm.weight, norm.eps)
    assert torch.equal(ri, want_res)  # the residual sum: one rounding, as torch's
    torch.testing.assert_close(xi, want_y, atol=ATOL[dtype], rtol=1e-2)
    x1, r1 = x[5:6].clone(), res[5:6].clone()
    ti.add_rms_norm_(x1, r1, norm.weight, norm.eps)
    assert torch.equal(x1.view(BITS[dtype]), xi[5:6].view(BITS[dtype]))


@pytest.mark.parametrize("vocab", [500, 1024, 3001])  # under, at and over one block
@pytest.mark.parametrize("log", [False, True])
def test_softmax_matches_torch_row_by_row(vocab: int, log: bool) -> None:
    gen = torch.Generator().manual_seed(vocab)
    x = _randn(gen, 9, vocab) * 6
    x[2, :vocab // 2] = float("-inf")  # banned tokens
    x[4, 7] = 80.0  # one token dominates
    got = ti.softmax(x, log)
    want = x.log_softmax(-1) if log else x.softmax(-1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    alone = _row_by_row(lambda r: ti.softmax(r, log), x)
    assert torch.equal(got.view(torch.int32), alone.view(torch.int32))


def test_softmax_takes_16_bit_logits() -> None:
    gen = torch.Generator().manual_seed(1)
    x = _randn(gen, 3, 700, dtype=torch.bfloat16)
    got = ti.softmax(x, True)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, x.float().log_softmax(-1), atol=1e-5, rtol=1e-5)


def test_use_triton_invariant_routes_a_model() -> None:
    """Every Linear on the Triton GEMM, every RMSNorm on its kernel, the fused CPU ops off;
    the model's forward then equals the torch path within fp32 rounding."""
    model = torch.nn.Sequential(Linear(72, 200, bias=True), RMSNorm(200),
                                Linear(200, 33, bias=False)).to(DEVICE)
    x = torch.randn(11, 72, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with torch.no_grad():
        want = model(x)
        assert use_triton_invariant(model) == 2
        assert all(m.kind == "triton" for m in model if isinstance(m, Linear))
        assert model[1].invariant and not model[1].fused
        got = model(x)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(_row_by_row(model, x).view(torch.int32), got.view(torch.int32))


def test_use_triton_invariant_refuses_a_packed_weight() -> None:
    from pagedllm import kernels
    from pagedllm.layers.linear import pack_linears

    if not kernels.available() or DEVICE != "cpu":
        pytest.skip("packs on CPU with pagedllm's kernels")
    model = torch.nn.Sequential(Linear(64, 64, bias=False))
    assert pack_linears(model) == 1
    with pytest.raises(ValueError, match="--batch-invariant"):
        use_triton_invariant(model)
