"""pagedllm's float32 and bfloat16 GEMMs on packed weights (``torch.ops.pagedllm.gemm_packed``,
kernels/csrc/gemm.cpp, gemm_bf16.cpp) against a float64 matmul of the same inputs: every
register-tile height (1-14 rows on AVX-512, rows cut into tiles of equal height, the chunks of
rows, x's rows packed k-major per tile with K not a multiple of 16), output widths that end
inside a 32-column panel, odd K (bf16 packs k in pairs), strided rows, bias, the threaded split;
bf16's rounding to nearest even; the 16-bit weights of fp32 layers (``pack_gemm_weight_w16``);
and the checks.
Run with ``PAGEDLLM_ISA=avx2`` (tests/layers/test_isa.py does) they test the AVX2 tiles."""

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


@pytest.mark.parametrize("m,n,k", [(1, 32, 16), (3, 40, 7), (8, 64, 48), (9, 64, 24), (13, 96, 33),
                                   (14, 64, 17), (17, 72, 40), (67, 100, 64), (130, 512, 256),
                                   (37, 1280, 256), (300, 96, 1030)])
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_get_the_same_bits_in_any_tile(dtype: torch.dtype) -> None:
    # M rows are cut into chunks of equal size and those into tiles of equal height (17: 5 + 6 +
    # 6 on AVX2; 29: 9 + 10 + 10 on AVX-512; 300 rows of K = 1,030: three chunks of 100 on
    # AVX-512, each packed per tile), over both threads; each output is still one fp32 sum in k
    # order, so every row equals the row computed alone
    if dtype == torch.bfloat16 and not torch.ops.pagedllm.gemm_bf16_vectorized():
        pytest.skip("this CPU has no AVX512-BF16")
    g = torch.Generator().manual_seed(7)
    for m, k in ((9, 96), (14, 96), (15, 96), (17, 96), (29, 96), (33, 96), (70, 96), (300, 1030)):
        w = torch.randn(640, k, generator=g).to(dtype)
        b = torch.randn(640, generator=g).to(dtype)
        packed = torch.ops.pagedllm.pack_gemm_weight(w)
        x = torch.randn(m, k, generator=g).to(dtype)
        y = torch.ops.pagedllm.gemm_packed(x, packed, 640, b)
        alone = torch.cat([torch.ops.pagedllm.gemm_packed(x[i:i + 1], packed, 640, b) for i in range(m)])
        assert torch.equal(y, alone), m


def test_checks_name_the_argument() -> None:
    w = torch.randn(64, 16)
    packed = torch.ops.pagedllm.pack_gemm_weight(w)
    with pytest.raises(RuntimeError, match="K = x's"):
        torch.ops.pagedllm.gemm_packed(torch.randn(2, 15), packed, 64, None)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.pagedllm.gemm_packed(torch.randn(2, 16).half(), packed, 64, None)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.pagedllm.gemm_packed(torch.randn(2, 16), packed, 64, torch.randn(63))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.pagedllm.pack_gemm_weight(w.half())


needs_bf16 = pytest.mark.skipif(
    os.environ.get("PAGEDLLM_CPU_KERNELS") == "0" or not kernels.available()
    or not torch.ops.pagedllm.gemm_bf16_vectorized(), reason="this CPU has no AVX512-BF16")


def _bf16_case(m: int, n: int, k: int, bias: bool) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(m * n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else torch.empty(0)
    x = torch.randn(m, k + 5, generator=g).bfloat16()[:, 2:2 + k]  # rows with a padded stride
    return x, w, b


@needs_bf16
@pytest.mark.parametrize("m,n,k", [(1, 32, 16), (1, 40, 1), (3, 40, 7), (8, 64, 48), (13, 96, 33),
                                   (17, 72, 40), (67, 100, 64), (130, 512, 255), (37, 1280, 256),
                                   (2100, 64, 40)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_equals_a_float64_matmul(m: int, n: int, k: int, bias: bool) -> None:
    x, w, b = _bf16_case(m, n, k, bias)
    packed = torch.ops.pagedllm.pack_gemm_weight(w)
    assert packed.dtype == torch.bfloat16 and packed.shape == (-(-n // 32), -(-k // 2), 64)
    y = torch.ops.pagedllm.gemm_packed(x, packed, n, b if bias else None)
    want = x.double() @ w.double().T + (b.double() if bias else 0)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    # bf16 products are exact in fp32; one fp32 sum of k of them (within k ulps of the
    # magnitudes summed), rounded once to bf16 (within half a bf16 ulp: 2^-8 relative)
    sums = x.double().abs() @ w.double().abs().T + (b.double().abs() if bias else 0)
    bound = 2.0**-8 * want.abs() + (k + 1) * torch.finfo(torch.float32).eps * sums * (1 + 2.0**-8)
    assert ((y.double() - want).abs() <= bound).all()


@needs_bf16
def test_bf16_rounds_each_output_once_to_nearest_even() -> None:
    # 1 + 2^-8 lies halfway between bf16 neighbours 1 and 1 + 2^-7: ties go to the even one (1);
    # 1 + 2^-7 + 2^-8 is halfway to 1 + 2^-6, which is even; just above a tie rounds up
    w = torch.tensor([[1.0, 2.0**-8], [1.0 + 2.0**-7, 2.0**-8], [1.0, 2.0**-8]] * 11
                     ).bfloat16()[:32]
    x = torch.tensor([[1.0, 1.0]]).bfloat16()
    b = torch.zeros(32).bfloat16()
    b[2::3] = 2.0**-16  # the third kind of column: a bias that lifts the tie
    y = torch.ops.pagedllm.gemm_packed(x, torch.ops.pagedllm.pack_gemm_weight(w), 32, b)[0].float()
    want = torch.tensor([1.0, 1.0 + 2.0**-6, 1.0 + 2.0**-7] * 11)[:32]
    assert torch.equal(y, want)


@needs_bf16
def test_bf16_odd_k_reads_nothing_past_the_row() -> None:
    # K = 5: the last k is paired with the packed zero; x's next element (the row's padding)
    # is NaN and must not reach the sum (NaN * 0 is NaN)
    full = torch.randn(9, 6).bfloat16()
    full[:, 5] = float("nan")
    x, w = full[:, :5], torch.randn(64, 5).bfloat16()
    y = torch.ops.pagedllm.gemm_packed(x, torch.ops.pagedllm.pack_gemm_weight(w), 64, None)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.float(), x.float() @ w.float().T, atol=2e-2, rtol=1e-2)


@needs_bf16
def test_bf16_threads_split_columns_with_the_same_bits() -> None:
    x, w, b = _bf16_case(70, 640, 96, True)  # 4.3M multiply-adds: over the threading threshold
    packed = torch.ops.pagedllm.pack_gemm_weight(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.ops.pagedllm.gemm_packed(x, packed, 640, b)
        torch.set_num_threads(max(2, threads))
        split = torch.ops.pagedllm.gemm_packed(x, packed, 640, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, split)


@needs_bf16
def test_bf16_checks_name_the_argument() -> None:
    w = torch.randn(64, 16).bfloat16()
    packed = torch.ops.pagedllm.pack_gemm_weight(w)
    with pytest.raises(RuntimeError, match="K = x's"):
        torch.ops.pagedllm.gemm_packed(torch.randn(2, 13).bfloat16(), packed, 64, None)
    with pytest.raises(RuntimeError, match="bias must be bfloat16"):
        torch.ops.pagedllm.gemm_packed(torch.randn(2, 16).bfloat16(), packed, 64, torch.randn(64))
    with pytest.raises(RuntimeError, match="pack_gemm_weight_w16's"):  # fp32 x on a bf16 packing
        torch.ops.pagedllm.gemm_packed(torch.randn(2, 16), packed, 64, None)
    with pytest.raises(RuntimeError, match="bfloat16 \\[ceil"):  # and the other way round
        torch.ops.pagedllm.gemm_packed(torch.randn(2, 16).bfloat16(),
                                       torch.ops.pagedllm.pack_gemm_weight(w.float()), 64, None)


def test_builds_for_the_isa_asked() -> None:
    """PAGEDLLM_ISA=avx2 on an AVX-512 machine really runs the AVX2 code (not the native build)."""
    asked = os.environ.get("PAGEDLLM_ISA", "auto")
    want = kernels.choose_isa(asked, kernels.cpu_flags())
    assert kernels.isa() == want == torch.ops.pagedllm.gemm_isa()
    assert torch.ops.pagedllm.gemm_vectorized() == (want != "generic")
    if want == "avx2":
        assert not torch.ops.pagedllm.gemm_bf16_vectorized()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 32, 16), (3, 40, 7), (7, 72, 40), (8, 64, 48), (13, 96, 33),
                                   (14, 64, 17), (17, 72, 40), (67, 100, 64), (37, 1280, 256),
                                   (300, 64, 1030)])
def test_w16_weights_give_the_bits_of_the_widened_weight(dtype: torch.dtype, m: int, n: int,
                                                         k: int) -> None:
    # 16-bit weights widened in registers (exact), the same fp32 sum in k order: the bits of
    # the float32 GEMM on w.float(), which test_equals_a_float64_matmul checks against float64
    g = torch.Generator().manual_seed(m * n + k)
    w, b = torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g)
    x = torch.randn(m, k + 3, generator=g)[:, 1:1 + k]
    packed = torch.ops.pagedllm.pack_gemm_weight_w16(w)
    assert packed.dtype == dtype and packed.shape == (-(-n // 32), k, 32)
    y = torch.ops.pagedllm.gemm_packed(x, packed, n, b)
    want = torch.ops.pagedllm.gemm_packed(x, torch.ops.pagedllm.pack_gemm_weight(w.float()), n, b)
    assert y.dtype == torch.float32 and torch.equal(y, want)
    torch.testing.assert_close(y, x @ w.float().T + b, rtol=1e-5, atol=1e-4)


def test_w16_checks_name_the_argument() -> None:
    packed = torch.ops.pagedllm.pack_gemm_weight_w16(torch.randn(64, 16).half())
    with pytest.raises(RuntimeError, match="K = x's"):
        torch.ops.pagedllm.gemm_packed(torch.randn(2, 15), packed, 64, None)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        torch.ops.pagedllm.gemm_packed(torch.randn(2, 16), packed, 64, torch.randn(64).half())
    with pytest.raises(RuntimeError, match="bfloat16 or float16"):
        torch.ops.pagedllm.pack_gemm_weight_w16(torch.randn(64, 16))


def test_fma_peak_is_a_rate() -> None:
    # GFLOP/s of a register-only FMA loop: positive, and at least one FMA of the build's
    # vector width per nanosecond per thread is far below any CPU's peak
    peak = torch.ops.pagedllm.gemm_fma_peak(100_000)
    lanes = {"avx512": 16, "avx2": 8}.get(torch.ops.pagedllm.gemm_isa(), 1)
    assert 0.05 * lanes < peak < 1e5


def test_read_bandwidth_is_a_rate() -> None:
    # GB/s of every thread reading its share of a 64 MiB buffer: at least 0.1 GB/s (a byte per
    # 10 ns: far slower than any memory), at most 10 TB/s (far faster)
    bw = torch.ops.pagedllm.gemm_read_bandwidth(64 << 20, 2)
    assert 0.1 < bw < 1e4


@pytest.mark.parametrize("m", [1, 5, 15, 70])
@pytest.mark.parametrize("after_kind", ["f32_big", "f32_small", "bf16_w16"])
def test_fetching_the_next_weight_changes_no_bits(m: int, after_kind: str) -> None:
    """``after`` (the packed weight the caller multiplies by next: decoder_layer.cpp's chain)
    only moves where the last panel's prefetches point: the same bits, serial or threaded, for
    a following weight split over the threads or not, of any dtype."""
    g = torch.Generator().manual_seed(m)
    w, x, b = torch.randn(1280, 768, generator=g), torch.randn(m, 768, generator=g), torch.randn(1280)
    packed = torch.ops.pagedllm.pack_gemm_weight(w)
    nxt = {"f32_big": lambda: torch.ops.pagedllm.pack_gemm_weight(torch.randn(4096, 768)),
           "f32_small": lambda: torch.ops.pagedllm.pack_gemm_weight(torch.randn(32, 8)),
           "bf16_w16": lambda: torch.ops.pagedllm.pack_gemm_weight_w16(
               torch.randn(768, 2048).to(torch.bfloat16))}[after_kind]()
    plain = torch.ops.pagedllm.gemm_packed(x, packed, 1280, b)
    assert torch.equal(torch.ops.pagedllm.gemm_packed(x, packed, 1280, b, nxt), plain)
