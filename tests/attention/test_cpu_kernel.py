"""The C++ paged decode kernel (pagedllm/kernels) against torch_ref, and its build: cached across
processes, and a clear warning plus the SDPA fallback where it cannot be built."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_backends import HEADS, TOL, compare_with_torch_ref, cpu_backend, make_batch

from pagedllm.attention.cpu import CpuBackend, paged_attention
from pagedllm.attention.quant import QMAX, QuantizedKV, quantize
from pagedllm.attention.torch_ref import TorchRefBackend

# Decode-only, ragged, around the kernel's 64-position tiles (1, 63, 64, 65, several tiles).
DECODES = [(c, 1) for c in (0, 62, 63, 64, 129, 299, 17)]


@pytest.fixture(scope="module")
def kernel() -> CpuBackend:
    return cpu_backend("kernel")


@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("block_size,head_dim", [(1, 64), (2, 64), (16, 64), (64, 64), (256, 64),
                                                 (512, 64), (16, 32), (16, 80), (16, 128)])
def test_decode_grid(kernel: CpuBackend, num_heads: int, num_kv_heads: int, block_size: int,
                     head_dim: int) -> None:
    compare_with_torch_ref(kernel, DECODES, block_size, num_heads, num_kv_heads, head_dim,
                           torch.float32, None, seed=block_size + head_dim)


# 8, 40 and 256 take the plain loops (not a multiple of 16, or past the AVX-512 templates); in
# bf16, 32, 64, 96 and 128 score with AVX512-BF16 dot products where the CPU has them.
@pytest.mark.parametrize("head_dim", [8, 32, 40, 64, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 1, 5, 64, 200])
def test_dtypes_dims_windows(kernel: CpuBackend, head_dim: int, dtype: torch.dtype,
                             window: int | None) -> None:
    reqs = [*DECODES, (5, 3), (40, 1), (0, 6)]  # with prefill chunks in the batch
    compare_with_torch_ref(kernel, reqs, 16, 8, 2, head_dim, dtype, window, seed=head_dim)


# Prefill chunks through the kernel: over several 16-token query chunks and 64-position tiles,
# fresh and after a cached prefix, beside decodes; windows shorter and longer than a chunk.
PREFILLS = [(0, 37), (20, 1), (100, 50), (0, 1), (5, 16), (64, 17), (0, 130), (3, 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 1, 7, 100])
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_prefill_chunks(kernel: CpuBackend, dtype: torch.dtype, window: int | None,
                        block_size: int) -> None:
    compare_with_torch_ref(kernel, PREFILLS, block_size, 12, 4, 64, dtype, window, seed=block_size)


I8, E4, E5 = torch.int8, torch.float8_e4m3fn, torch.float8_e5m2


@pytest.mark.parametrize("kd,vd", [(I8, I8), (None, I8), (I8, None), (E4, E4), (E5, E5), (E5, E4)])
@pytest.mark.parametrize("dtype,block_size", [(torch.float32, 16), (torch.bfloat16, 1)])
def test_quantized_cache(kernel: CpuBackend, kd: torch.dtype | None, vd: torch.dtype | None,
                         dtype: torch.dtype, block_size: int) -> None:
    """Same quantized cache in, same output as torch_ref at the unquantized tolerance:
    dequantizing (value x bf16 scale) is exact in fp32 on both sides."""
    gen = torch.Generator().manual_seed(3)
    meta, nb = make_batch([*DECODES, (9, 4)], block_size, gen)
    t, hq, hkv, d = meta.num_tokens, 8, 2, 64
    q, k, v = (torch.randn(t, h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv))

    def cache(dt: torch.dtype | None) -> torch.Tensor | QuantizedKV:
        x = torch.randn(nb, block_size, hkv, d, generator=gen).to(dtype)
        return x if dt is None else QuantizedKV(*quantize(x, dt))

    kc, vc = cache(kd), cache(vd)
    ref = TorchRefBackend().forward(q, k, v, kc, vc, meta, d**-0.5)
    out = kernel.forward(q, k, v, kc, vc, meta, d**-0.5)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("fp8", [E4, E5])
def test_fp8_rows_widen_exactly_for_every_code(kernel: CpuBackend, fp8: torch.dtype,
                                               heads: int) -> None:
    """Every finite fp8 code (normal, subnormal, both zeros) through the kernel's widening: a
    request's only position attends with weight exactly 1, so the output is its V row as the
    kernel widened it, equal to torch's own conversion. One head of 256 codes (rows converted
    first: common.h fp8_bits_to_float or its table), or two of 128 (on AVX2 widened in the
    loops: attention_tile.h row8); each half holds the format's largest magnitude, so each
    row's scale is 1."""
    gen = torch.Generator().manual_seed(5)
    meta, nb = make_batch([(0, 1)], 16, gen)
    codes = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    codes[~torch.isfinite(codes)] = 0.0  # NaN / inf codes: never in a quantized cache
    assert codes.abs().max() == QMAX[fp8]  # the row's scale is then exactly 1
    d = 256 // heads
    v_new = codes.view(1, heads, d)
    q, k = torch.randn(2, 1, heads, d, generator=gen)
    vc = QuantizedKV(torch.zeros(nb, 16, heads, d, dtype=fp8),
                     torch.ones(nb, 16, heads, dtype=torch.bfloat16))
    out = kernel.forward(q, k, v_new, torch.zeros(nb, 16, heads, d), vc, meta, d**-0.5)
    assert torch.equal(out.view(256), codes)


@pytest.mark.parametrize("heads", [(8, 2), (12, 4), (10, 2), (12, 2)])
@pytest.mark.parametrize("kd,vd", [(I8, I8), (E4, E5), (E5, I8)])
def test_quantized_rows_give_the_bits_of_their_values_in_fp32(kernel: CpuBackend,
                                                              kd: torch.dtype, vd: torch.dtype,
                                                              heads: tuple[int, int]) -> None:
    """Over int8 / fp8 rows (on AVX2 read as stored and widened once per block of query rows,
    elsewhere converted first) the kernel gives bit for bit its output over the same values
    dequantized into an fp32 cache: value x bf16 scale is exact in fp32, and either way the
    loops see it. GQA groups of 4, 3, 5 and 6 (and prefill chunks of 4 tokens) leave every
    remainder of the AVX2 loops' blocks of 3 (scores) and 4 (values) query rows."""
    gen = torch.Generator().manual_seed(4)
    meta, nb = make_batch([*DECODES, (9, 4)], 16, gen)
    (hq, hkv), t, d = heads, meta.num_tokens, 64
    q, k, v = (torch.randn(t, h, d, generator=gen) for h in (hq, hkv, hkv))
    kc, vc = (QuantizedKV(*quantize(torch.randn(nb, 16, hkv, d, generator=gen), dt))
              for dt in (kd, vd))
    out = kernel.forward(q, k, v, kc, vc, meta, d**-0.5)
    deq = [c.data.float() * c.scale.float().unsqueeze(-1) for c in (kc, vc)]  # after the write
    k2, v2 = (x.view(-1, hkv, d)[meta.slot_mapping] for x in deq)  # the new rows as stored
    again = kernel.forward(q, k2, v2, deq[0].clone(), deq[1].clone(), meta, d**-0.5)
    assert torch.equal(out, again)


def test_online_softmax_across_tiles(kernel: CpuBackend) -> None:
    """Peaked scores whose maximum moves from tile to tile (|q| ~ 30): the running max and the
    rescaling of the accumulator must keep every tile's share exact."""
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        meta, nb = make_batch([(c, 1) for c in (300, 190, 65)], 16, gen)
        q = torch.randn(meta.num_tokens, 4, 64, generator=gen) * 30
        k, v = torch.randn(2, meta.num_tokens, 2, 64, generator=gen)
        kc, vc = torch.randn(2, nb, 16, 2, 64, generator=gen)
        ref = TorchRefBackend().forward(q, k, v, kc.clone(), vc.clone(), meta, 0.125)
        out = kernel.forward(q, k, v, kc, vc, meta, 0.125)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("reqs", [DECODES, [(200, 1)], PREFILLS])  # (200, 1): kv heads split
def test_same_bits_at_any_thread_count(kernel: CpuBackend, reqs: list[tuple[int, int]]) -> None:
    gen = torch.Generator().manual_seed(4)
    meta, nb = make_batch(reqs, 16, gen)
    q = torch.randn(meta.num_tokens, 8, 64, generator=gen)
    kc, vc = torch.randn(2, nb, 16, 4, 64, generator=gen)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            out = torch.zeros_like(q)
            paged_attention(q, kc, vc, meta, 0.125, None, out, meta.num_tokens)
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_strided_caches_and_untouched_prefill_rows(kernel: CpuBackend) -> None:
    """Caches with padded strides (a view into a bigger allocation) are read through their
    strides; rows of requests with more query tokens than max_query_len are not written."""
    gen = torch.Generator().manual_seed(5)
    reqs = [(10, 1), (0, 4), (33, 1)]
    meta, nb = make_batch(reqs, 4, gen)
    big = torch.randn(2, nb, 4, 3, 80, generator=gen)
    kc, vc = big[0, :, :, :2, :64], big[1, :, :, 1:, 8:72]  # [nb, 4, 2, 64], strided
    q = torch.randn(meta.num_tokens, 4, 64, generator=gen)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, kc, vc, meta, 0.125, None, out, 1)
    # torch_ref writes the new tokens' K/V first: give it what their slots already hold
    k_new, v_new = (c.reshape(-1, 2, 64)[meta.slot_mapping] for c in (kc, vc))
    ref = TorchRefBackend().forward(q, k_new, v_new, kc.contiguous(), vc.contiguous(), meta, 0.125)
    decode_rows = [0, 5]
    torch.testing.assert_close(out[decode_rows], ref[decode_rows], atol=1e-5, rtol=1e-5)
    assert out[1:5].isnan().all()
    paged_attention(q, kc, vc, meta, 0.125, None, out, 4)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_errors_name_the_problem(kernel: CpuBackend) -> None:
    gen = torch.Generator().manual_seed(6)
    meta, nb = make_batch([(5, 1)], 4, gen)
    q = torch.randn(1, 4, 32)
    kc, vc = torch.randn(2, nb, 4, 2, 32)
    meta.block_tables = meta.block_tables.long()
    with pytest.raises(RuntimeError, match="int32"):
        paged_attention(q, kc, vc, meta, 1.0, None, torch.empty_like(q), 1)
    meta, nb = make_batch([(5, 1)], 4, gen)
    data, scale = quantize(kc, torch.int8)
    with pytest.raises(RuntimeError, match="needs its scales"):
        torch.ops.pagedllm.paged_attention(q, data, None, vc, None, meta.block_tables,
                                           meta.seq_lens, meta.query_start_loc,
                                           torch.empty_like(q), 1.0, None, 1)
    meta.seq_lens = torch.tensor([100], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="does not fit its block table"):
        paged_attention(q, kc, vc, meta, 1.0, None, torch.empty_like(q), 1)
    with pytest.raises(RuntimeError, match="heads"):
        paged_attention(torch.randn(1, 3, 32), kc, vc, meta, 1.0, None, torch.empty(1, 3, 32), 1)


# -- the build: cache, fallback ---------------------------------------------------------------

_PROBE = """
import warnings, torch
warnings.simplefilter("always")
from pagedllm import kernels
from pagedllm.attention import get_backend
from pagedllm.attention.torch_ref import TorchRefBackend
import sys; sys.path.insert(0, {tests!r})
from test_backends import compare_with_torch_ref
b = get_backend(None, "cpu")
print("use_kernel", b.use_kernel, flush=True)
compare_with_torch_ref(b, [(9, 1), (30, 1), (4, 3)], 4, 8, 2, 32, torch.float32, None)
print("matches torch_ref", flush=True)
from pagedllm.layers import RMSNorm, SiluAndMul
with torch.inference_mode():  # the layers' fused ops fall back (or run) too
    x = torch.randn(3, 16)
    torch.testing.assert_close(RMSNorm(16)(x), RMSNorm(16)._norm(x))
    torch.testing.assert_close(SiluAndMul()(x), torch.nn.functional.silu(x[:, :8]) * x[:, 8:])
print("layers ok", flush=True)
"""


def _probe(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run _PROBE in a fresh process; INFO logs on (they say when it compiles)."""
    code = _PROBE.format(tests=str(Path(__file__).parent))
    env = {**os.environ, "PAGEDLLM_LOG_LEVEL": "INFO", **env}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("cxx", ["/nonexistent/c++", pytest.param("false", marks=pytest.mark.slow)])
def test_no_compiler_falls_back_with_one_warning(tmp_path: Path, cxx: str) -> None:
    """A missing compiler (or one that fails): one warning naming the cause and the fix, and
    the backend runs (correctly) on its SDPA path."""
    r = _probe({"CXX": cxx, "PAGEDLLM_CACHE_DIR": str(tmp_path), "PAGEDLLM_CPU_KERNELS": "1"})
    assert r.returncode == 0, r.stderr
    assert "use_kernel False" in r.stdout and "layers ok" in r.stdout
    assert r.stderr.count("pagedllm CPU kernels unavailable") == 1, r.stderr
    assert cxx in r.stderr and "Install a C++ compiler" in r.stderr
    assert not list(tmp_path.rglob("*.so"))


@pytest.mark.slow
def test_switched_off_by_env(tmp_path: Path) -> None:
    r = _probe({"PAGEDLLM_CPU_KERNELS": "0", "PAGEDLLM_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert "use_kernel False" in r.stdout and "layers ok" in r.stdout
    assert "unavailable" not in r.stderr and not list(tmp_path.rglob("*"))


def test_second_process_loads_the_cached_build(kernel: CpuBackend) -> None:
    """This process built (or loaded) the library; another one loads it without compiling."""
    r = _probe({"PAGEDLLM_CPU_KERNELS": "1"})
    assert r.returncode == 0, r.stderr
    assert "use_kernel True" in r.stdout and "layers ok" in r.stdout
    assert "compiling" not in r.stderr


@pytest.mark.slow
def test_fresh_cache_compiles_once(tmp_path: Path) -> None:
    env = {"PAGEDLLM_CACHE_DIR": str(tmp_path), "PAGEDLLM_CPU_KERNELS": "1"}
    first, second = _probe(env), _probe(env)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert "compiling" in first.stderr and "compiling" not in second.stderr
    assert "compiled pagedllm CPU kernels: done in" in first.stderr
    assert "use_kernel True" in first.stdout and "use_kernel True" in second.stdout
    assert len(list(tmp_path.rglob("*.so"))) == 1
