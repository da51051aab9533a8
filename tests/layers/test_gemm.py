"""pagedllm's float32 GEMM on packed weights (``torch.ops.pagedllm.gemm_packed``,
kernels/csrc/gemm.cpp) against a float64 matmul: every register-tile height (1-8 rows and the
64-row chunks), output widths that end inside a 32-column panel, strided rows, bias, the
threaded split; and its checks."""

from __future__ import annotations

import os

import pytest
import torch

from pagedllm import kernels


@pytest.fixture(autouse=True)
def _kernels() -> None:
    if os.environ.get("PAGEDLLM_CPU_KERNELS") == "0":
        pytest.skip("CPU kernels switched off by PAGEDLLM_CPU_KERNELS=0")
    assert kernels.available(), f"CPU kernels did not build: {kernels.unavailable_reason()}"


@pytest.mark.parametrize("m,n,k", [(1, 32, 16), (3, 40, 7), (8, 64, 48), (13, 96, 33),
                                   (67, 100, 64), (130, 512, 256), (37, 1280, 256)])
@pytest.mark.parametrize("bias", [False, True])
def test_equals_a_float64_matmul(m: int, n: int, k: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(m * n + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(m, k + 5, generator=g)[:, 2:2 + k]  # rows with a padded stride
    packed = torch.ops.pagedllm.pack_gemm_weight(w)
    assert packed.shape == (-(-n // 32), k, 32)
    y = torch.ops.pagedllm.gemm_packed(x, packed, n, b)
    want = x.double() @ w.double().T + (0 if b is None else b.double())
    assert y.dtype == torch.float32 and y.shape == (m, n)
    # one fp32 sum of k products per output: within k ulps of the magnitudes summed
    bound = k * torch.finfo(torch.float32).eps * (x.double().abs() @ w.double().abs().T + 1)
    assert ((y.double() - want).abs() <= bound).all()


def test_checks_name_the_argument() -> None:
    w = torch.randn(64, 16)
    packed = torch.ops.pagedllm.pack_gemm_weight(w)
    with pytest.raises(RuntimeError, match="K = x's"):
        torch.ops.pagedllm.gemm_packed(torch.randn(2, 15), packed, 64, None)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.pagedllm.gemm_packed(torch.randn(2, 16).half(), packed, 64, None)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.pagedllm.gemm_packed(torch.randn(2, 16), packed, 64, torch.randn(63))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.pagedllm.pack_gemm_weight(w.bfloat16())
