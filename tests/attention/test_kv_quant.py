"""Quantized KV (int8 / fp8 values + per-token, per-head bf16 scales): round-trip error bounds,
backends against torch_ref on the same quantized cache (tight, caches bit-identical after the
write), quantized against unquantized attention (stated bounds), block moves bit-exact, config,
pool sizing and errors. Triton runs in the interpreter (TRITON_INTERPRET=1, as test_triton.py).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from aot_compile import compile_kernels  # noqa: E402
from test_backends import TOL, cpu_backend, forward_on, make_batch  # noqa: E402

from pagedllm.attention import get_backend  # noqa: E402
from pagedllm.attention.quant import (  # noqa: E402
    QMAX,
    SCALE_DTYPE,
    QuantizedKV,
    ceil_bf16,
    dequantize,
    quantize,
    raw,
)
from pagedllm.attention.torch_ref import TorchRefBackend  # noqa: E402
from pagedllm.config import CacheConfig, ModelConfig, SchedulerConfig  # noqa: E402

I8, E4, E5 = torch.int8, torch.float8_e4m3fn, torch.float8_e5m2
# (relative mantissa step, smallest subnormal step) of each storage dtype, in units of the scale
GRID = {I8: (0.0, 1.0), E4: (2.0**-3, 2.0**-9), E5: (2.0**-2, 2.0**-16)}


def _triton_ok() -> bool:
    try:
        from pagedllm.attention.triton import common
    except ImportError:
        return False
    return common.INTERPRET or torch.cuda.is_available()


# "cpu" runs the C++ decode kernel, "cpu-sdpa" the CPU backend's SDPA fallback
BACKENDS = ["cpu", "cpu-sdpa", pytest.param("triton", marks=pytest.mark.skipif(
    not _triton_ok(), reason="triton missing, or imported without TRITON_INTERPRET=1 and no GPU"))]


def _rows(gen: torch.Generator) -> torch.Tensor:
    """[64, 4, 48] rows over 12 decades of magnitude, an all-zero row, wide in-row ranges."""
    x = torch.randn(64, 4, 48, generator=gen)
    x *= 10.0 ** torch.empty(64, 4, 1).uniform_(-6, 6, generator=gen)
    x[0, 0] = 0.0
    x[1, 1, 5] = 1e4  # one huge element: the others fall to the subnormal grid
    return x


@pytest.mark.parametrize("dtype", [I8, E4, E5])
def test_quantize_round_trip_bounds(dtype: torch.dtype) -> None:
    x = _rows(torch.Generator().manual_seed(0))
    q, s = quantize(x, dtype)
    assert q.dtype == dtype and s.dtype == SCALE_DTYPE and s.shape == x.shape[:-1]
    amax, sf = x.abs().amax(-1), s.float()
    # scale = amax / qmax rounded up to bf16: never clips, at most one bf16 step (2^-7) above
    assert (sf * QMAX[dtype] >= amax).all()
    assert (sf <= (amax / QMAX[dtype]).clamp_min(1e-32) * (1 + 2.0**-7)).all()
    assert (q.float().abs() <= QMAX[dtype]).all()
    err = (dequantize(q, s) - x).abs()
    rel, sub = GRID[dtype]
    if dtype == I8:  # half a step of the scale
        bound = sf[..., None] * 0.5 * (1 + 1e-6)
    else:  # half a mantissa step, or half a subnormal step of the scaled grid
        bound = torch.maximum(x.abs() * rel / 2, sf[..., None] * sub / 2) * (1 + 1e-6)
    assert (err <= bound).all(), (err - bound).max()
    assert torch.equal(dequantize(q, s)[0, 0], torch.zeros(48))  # zero row stays zero, no NaN
    # relative error of a typical row, the figures the docs quote
    typical = x[2:] / x[2:].abs().amax(-1, keepdim=True)
    e = (dequantize(*quantize(typical, dtype)) - typical).abs().max().item()
    assert e <= {I8: 1 / 254 * 1.01, E4: 1 / 16, E5: 1 / 8}[dtype]


def test_ceil_bf16_is_exact_and_rounds_up() -> None:
    x = torch.rand(10_000) * 10.0 ** torch.empty(10_000).uniform_(-30, 30)
    c = ceil_bf16(x)
    assert (c.float() >= x).all()
    # the next bf16 value below c is below x: c is the smallest bf16 >= x
    below = (c.float().view(torch.int32) - 65536).view(torch.float32)
    assert (below < x).all()


def _qcache(shape: tuple[int, ...], dtype: torch.dtype | None, gen: torch.Generator,
            fdtype: torch.dtype) -> torch.Tensor | QuantizedKV:
    x = torch.randn(*shape, generator=gen).to(fdtype)
    return x if dtype is None else QuantizedKV(*quantize(x, dtype))


def _clone(c: torch.Tensor | QuantizedKV) -> torch.Tensor | QuantizedKV:
    return QuantizedKV(c.data.clone(), c.scale.clone()) if isinstance(c, QuantizedKV) else c.clone()


def _ref_quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The storage format restated without quantize(): scale = the smallest bf16 >= amax / qmax,
    values x / scale rounded half up (int8) or to nearest (fp8)."""
    qmax = QMAX[dtype]
    want = x.float().abs().amax(-1) / qmax
    s = want.to(SCALE_DTYPE)
    s = torch.where(s.float() < want, torch.nextafter(s, torch.full_like(s, float("inf"))), s)
    y = x.float() / s.float().unsqueeze(-1)
    q = torch.floor(y + 0.5).clamp(-qmax, qmax).to(dtype) if dtype == I8 else y.to(dtype)
    return q, s


def _assert_written(after: torch.Tensor | QuantizedKV, before: torch.Tensor | QuantizedKV,
                    x: torch.Tensor, slots: torch.Tensor) -> None:
    """Rows x [T, Hkv, D] stored at ``slots`` in the storage format, every other slot untouched:
    an independent check of the write (torch_ref and cpu share one write_kv)."""
    written = torch.zeros(after.shape[0] * after.shape[1], dtype=torch.bool)
    written[slots] = True
    if isinstance(after, QuantizedKV):
        assert isinstance(before, QuantizedKV)
        q, s = _ref_quantize(x, after.dtype)
        planes = [(raw(after.data), raw(before.data), raw(q)), (after.scale, before.scale, s)]
    else:
        assert isinstance(before, torch.Tensor)
        planes = [(after, before, x.to(after.dtype))]
    for new, old, want in planes:
        new, old = new.flatten(0, 1), old.flatten(0, 1)  # [slots, ...]
        assert torch.equal(new[slots], want)
        assert torch.equal(new[~written], old[~written])


def _same(a: torch.Tensor | QuantizedKV, b: torch.Tensor | QuantizedKV) -> bool:
    if isinstance(a, QuantizedKV) and isinstance(b, QuantizedKV):
        return torch.equal(raw(a.data), raw(b.data)) and torch.equal(a.scale, b.scale)
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)


# K, V storage: both int8, V only (the "keys need 16 bits" choice), K only, fp8 both, mixed fp8
KV_COMBOS = [(I8, I8), (None, I8), (I8, None), (E4, E4), (E5, E4)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kd,vd", KV_COMBOS)
@pytest.mark.parametrize("dtype,block_size", [(torch.float32, 16), (torch.float16, 4)])
def test_backend_matches_reference_on_quantized_cache(
    backend: str, kd: torch.dtype | None, vd: torch.dtype | None, dtype: torch.dtype,
    block_size: int,
) -> None:
    """Same quantized cache in, same attention out (at the unquantized tolerance), and the new
    tokens' quantized values and scales written bit-identically to torch_ref's."""
    gen = torch.Generator().manual_seed(1)
    # prefill from scratch, decode, chunk after cached context, decode with a long context
    meta, nb = make_batch([(0, 7), (13, 1), (40, 5), (70, 1), (3, 1)], block_size, gen)
    t, hq, hkv, d = meta.num_tokens, 8, 2, 64
    q, k, v = (torch.randn(t, h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv))
    kc = _qcache((nb, block_size, hkv, d), kd, gen, dtype)
    vc = _qcache((nb, block_size, hkv, d), vd, gen, dtype)
    kc2, vc2 = _clone(kc), _clone(vc)
    k0, v0 = _clone(kc), _clone(vc)
    ref = TorchRefBackend().forward(q, k, v, kc, vc, meta, d**-0.5)
    device = "cpu"
    if backend.startswith("cpu"):
        be = cpu_backend("kernel" if backend == "cpu" else "sdpa")
    else:
        from pagedllm.attention.triton import common

        device = "cpu" if common.INTERPRET else "cuda"
        be = get_backend(backend, device)
    out = forward_on(device, be, q, k, v, kc2, vc2, meta, d**-0.5)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    _assert_written(kc2, k0, k, meta.slot_mapping)
    _assert_written(vc2, v0, v, meta.slot_mapping)
    assert _same(kc, kc2) and _same(vc, vc2)


# Stated bounds: random N(0, 1) K/V, q ~ N(0, 4), head_dim 64, contexts up to 304 tokens; the
# largest ||out_q - out|| / ||out|| over rows (measured: int8 0.037, V-only int8 0.008,
# K-only int8 0.037, fp8_e4m3 0.10, fp8_e5m2 0.19).
ATTN_BOUND = {(I8, I8): 0.06, (None, I8): 0.015, (I8, None): 0.06, (E4, E4): 0.15,
              (E5, E5): 0.3}


@pytest.mark.parametrize("kd,vd", list(ATTN_BOUND))
def test_quantized_vs_unquantized_attention_bound(
    kd: torch.dtype | None, vd: torch.dtype | None
) -> None:
    gen = torch.Generator().manual_seed(2)
    meta, nb = make_batch([(0, 9), (100, 1), (300, 4), (37, 1)], 16, gen)
    t, hq, hkv, d = meta.num_tokens, 8, 2, 64
    q = torch.randn(t, hq, d, generator=gen) * 2
    k, v = torch.randn(t, hkv, d, generator=gen), torch.randn(t, hkv, d, generator=gen)
    kc, vc = torch.randn(nb, 16, hkv, d, generator=gen), torch.randn(nb, 16, hkv, d, generator=gen)
    ref = TorchRefBackend().forward(q, k, v, kc.clone(), vc.clone(), meta, d**-0.5)

    def quant(c: torch.Tensor, dt: torch.dtype | None) -> torch.Tensor | QuantizedKV:
        return c.clone() if dt is None else QuantizedKV(*quantize(c, dt))

    out = TorchRefBackend().forward(q, k, v, quant(kc, kd), quant(vc, vd), meta, d**-0.5)
    rel = ((out - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert rel <= ATTN_BOUND[(kd, vd)]
    assert rel > 0  # it did quantize


# -- the KV tensors: planes, views, block moves ------------------------------------------------
def _model(dtype: str = "float32") -> ModelConfig:
    return ModelConfig(
        model="m", architecture="LlamaForCausalLM", vocab_size=32, hidden_size=64,
        intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, rms_norm_eps=1e-6, max_position_embeddings=256, rope_theta=1e4,
        rope_scaling=None, attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
        hidden_act="silu", sliding_window=None, dtype=dtype,
    )


def _snapshot(cache) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    return [raw(p).clone() for p in cache.planes]


@pytest.mark.parametrize("kv", [("int8", "int8"), ("auto", "int8"), ("fp8_e4m3", "auto"),
                                ("fp8_e5m2", "int8")])
def test_kv_cache_moves_quantized_blocks_bit_exactly(kv: tuple[str, str]) -> None:
    from pagedllm.runner.kv_cache import KVCache

    m = _model()
    cache = KVCache(m, 6, 4, "cpu", num_host_blocks=4, k_cache_dtype=kv[0], v_cache_dtype=kv[1])
    cfg = CacheConfig(block_size=4, k_cache_dtype=kv[0], v_cache_dtype=kv[1])
    assert cache.nbytes == 6 * cfg.kv_bytes_per_block(m)  # sizing counts exactly what is stored
    for i, (kc, vc) in enumerate(cache.layers):
        assert isinstance(kc, QuantizedKV) == (kv[0] != "auto")
        assert isinstance(vc, QuantizedKV) == (kv[1] != "auto")
        gen = torch.Generator().manual_seed(i)
        x = torch.randn(24, 2, 32, generator=gen) * 10.0 ** torch.randn(24, 2, 1, generator=gen)
        from pagedllm.attention.base import write_kv

        write_kv(x, -x, kc, vc, torch.arange(24))  # every slot of every block
    before = _snapshot(cache)

    def block(snap: list[torch.Tensor], b: int) -> list[torch.Tensor]:
        return [p[:, :, b] for p in snap]

    cache.copy_blocks([(1, 5), (5, 0)])  # reads before writes: block 0 gets the old block 5
    after = _snapshot(cache)
    for x, y in zip(block(after, 5) + block(after, 0), block(before, 1) + block(before, 5),
                    strict=True):
        assert torch.equal(x, y)
    cache.swap_out([(2, 3), (4, 0)])
    cache.copy_blocks([(0, 2), (0, 4)])  # clobber the device copies
    cache.swap_in([(3, 2), (0, 4)])
    final = _snapshot(cache)
    for b in (2, 4):
        for x, y in zip(block(final, b), block(before, b), strict=True):
            assert torch.equal(x, y)
    cache.resize(9)  # grow keeps blocks (values and scales), new ones zero
    assert cache.num_blocks == 9 and all(p.shape[2] == 9 for p in cache.planes)
    for x, y in zip(block(_snapshot(cache), 2), block(before, 2), strict=True):
        assert torch.equal(x, y)
    kc, _ = cache.layers[0]
    assert kc.shape[0] == 9  # views rebound


# -- config, pool sizing, errors ---------------------------------------------------------------
def test_bytes_per_token_and_pool_sizing() -> None:
    from pagedllm.kv.plan import plan_kv_pool

    sched = SchedulerConfig(max_model_len=64)
    for model_dtype, elem in (("float32", 4), ("bfloat16", 2)):
        m = _model(model_dtype)
        unit = m.num_hidden_layers * m.num_key_value_heads  # per (layer, head)
        full = CacheConfig(kv_cache_memory=1 << 20)
        assert full.kv_bytes_per_token(m) == m.kv_bytes_per_token == unit * 2 * 32 * elem
        q8 = CacheConfig(kv_cache_memory=1 << 20, k_cache_dtype="int8", v_cache_dtype="int8")
        assert q8.kv_bytes_per_token(m) == unit * 2 * (32 + 2)
        mixed = CacheConfig(kv_cache_memory=1 << 20, v_cache_dtype="int8")
        assert mixed.kv_bytes_per_token(m) == unit * (32 * elem + 32 + 2)
        saved = 1 - q8.kv_bytes_per_token(m) / full.kv_bytes_per_token(m)
        assert saved >= (0.70 if elem == 4 else 0.45)  # the targets, even at head_dim 32
        p_full, p_q8 = plan_kv_pool(m, full, sched), plan_kv_pool(m, q8, sched)
        assert p_q8.num_blocks == (1 << 20) // (q8.kv_bytes_per_token(m) * 16)
        assert p_q8.num_blocks > p_full.num_blocks * (1.8 if elem == 2 else 3.5)
    assert CacheConfig(v_cache_dtype="int8").kv_dtype_label(_model()) == (
        "K float32 + V int8 (bf16 scales)"
    )


def test_dtype_names_and_errors(tiny_models, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from pagedllm import LLM, EngineArgs
    from pagedllm.attention import registry
    from pagedllm.attention.cpu import CpuBackend

    model = str(tiny_models["llama"])
    c = EngineArgs(model, kv_cache_dtype="fp8", v_cache_dtype="auto").create_engine_config().cache
    assert (c.k_cache_dtype, c.v_cache_dtype) == ("fp8_e4m3", "auto")
    c = EngineArgs(model, k_cache_dtype="int8").create_engine_config().cache
    assert (c.k_cache_dtype, c.v_cache_dtype) == ("int8", "auto")
    with pytest.raises(ValueError, match="v_cache_dtype='int4' is not supported; choose one of"):
        EngineArgs(model, v_cache_dtype="int4").create_engine_config()
    with pytest.raises(ValueError, match="kv_cache_dtype='fp16'"):
        EngineArgs(model, kv_cache_dtype="fp16").create_engine_config()
    with pytest.raises(ValueError, match="k_cache_dtype"):
        CacheConfig(k_cache_dtype="fp8")  # aliases are resolved before the frozen config

    class Plain(CpuBackend):
        name = "plain"
        supports_quantized_kv = False

    monkeypatch.setitem(registry._BACKENDS, "plain", Plain)
    with pytest.raises(ValueError, match="does not read a quantized KV cache.*torch_ref, cpu"):
        LLM(model=model, attention_backend="plain", kv_cache_dtype="int8", max_model_len=64)
    LLM(model=model, attention_backend="plain", max_model_len=64)  # unquantized: fine
    if _triton_ok():
        from pagedllm.attention.triton.common import check_cache

        z = torch.zeros(2, 4, 1, 8, dtype=torch.int8)
        with pytest.raises(AssertionError, match="needs its scales"):
            check_cache(z, z)


_COMPILE_BODY = """
for arch, qt, qmax in [(90, "i8", 127.0), (90, "fp8e4nv", 448.0), (90, "fp8e5", 57344.0),
                       (80, "i8", 127.0)]:
    for dt in ("fp16", "bf16", "fp32"):
        up = dt == "fp32"
        ptrs = {"q_ptr": "*" + dt, "out_ptr": "*" + dt, "k_cache_ptr": "*" + qt,
                "v_cache_ptr": "*" + qt, "k_scale_ptr": "*bf16", "v_scale_ptr": "*bf16"}
        q = dict(K_QUANT=True, V_QUANT=True, DOT_FP32=up, PRECISION="ieee" if up else "tf32")
        compile_for(decode._decode_kernel, ptrs, dict(GROUP=4, GROUP_PAD=16, BLOCK_SIZE=16,
                    TILE_N=64, BLOCK_D=64, USE_WINDOW=False, SPLIT=False, **q), arch)
        compile_for(prefill._prefill_kernel, ptrs, dict(GROUP=4, BLOCK_M=64, BLOCK_Q=16,
                    BLOCK_SIZE=16, TILE_N=64, BLOCK_D=64, USE_WINDOW=False, **q), arch)
        compile_for(kv_write._kv_write_kernel, {"k_ptr": "*" + dt, "v_ptr": "*" + dt,
                    "k_cache_ptr": "*" + qt, "v_cache_ptr": "*" + dt, "k_scale_ptr": "*bf16",
                    "v_scale_ptr": "*bf16", "slot_ptr": "*i64"},
                    dict(BLOCK_SIZE=16, BLOCK_H=2, BLOCK_D=64, K_QMAX=qmax, K_INT=qt == "i8"), arch)
print("compiled")
"""


@pytest.mark.slow
def test_quantized_kernels_compile_for_gpu() -> None:
    """Ahead-of-time compile of the quantized kernel variants (no GPU needed): int8 on sm_80 and
    sm_90, fp8 e4m3 / e5m2 on sm_90."""
    compile_kernels(_COMPILE_BODY)


@pytest.mark.parametrize("kv", [("auto", "auto"), ("int8", "int8"), ("fp8_e4m3", "int8")])
def test_kv_cache_exports_and_imports_tier_payloads_with_scales(kv: tuple[str, str]) -> None:
    """The KV tier's payload path: a block exported from one cache and imported into another
    (another replica) is bit-exact, scales included; a payload of another layout does not fit."""
    from pagedllm.attention.base import write_kv
    from pagedllm.runner.kv_cache import KVCache

    m = _model()
    a = KVCache(m, 6, 4, "cpu", k_cache_dtype=kv[0], v_cache_dtype=kv[1])
    b = KVCache(m, 6, 4, "cpu", k_cache_dtype=kv[0], v_cache_dtype=kv[1])
    for i, (kc, vc) in enumerate(a.layers):
        x = torch.randn(24, 2, 32, generator=torch.Generator().manual_seed(i))
        write_kv(x, -x, kc, vc, torch.arange(24))
    payloads = a.export_blocks([2, 4])
    assert all(b.payload_fits(p) for p in payloads)
    b.import_blocks([(payloads[0], 0), (payloads[1], 5)])
    for pa, pb in zip(_snapshot(a), _snapshot(b), strict=True):
        assert torch.equal(pa[:, :, 2], pb[:, :, 0]) and torch.equal(pa[:, :, 4], pb[:, :, 5])
    other = KVCache(m, 2, 4, "cpu", k_cache_dtype="auto" if kv[0] != "auto" else "int8")
    assert not other.payload_fits(payloads[0])
    bad = dict(payloads[0])
    bad.pop("p0")
    assert not b.payload_fits(bad)
