"""One ``bench kernel`` case: the same attention step paged (a backend over a shuffled block pool)
and contiguous (SDPA), checked to agree, plus the CPU backend's gather and contiguous decode with
a length mask (see ``bench.kernel`` for what is timed and reported)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from pagedllm.bench.device import is_cuda

# (atol, rtol) of the paged-vs-contiguous check: both sides round their output to the dtype
TOLERANCE = {"float32": (1e-3, 0.0), "float16": (2e-2, 2e-2), "bfloat16": (2e-2, 2e-2)}


class Case(NamedTuple):
    paged: Callable[[], Any]
    contiguous: Callable[[], Any]
    gather: Callable[[], Any] | None  # CPU backend only
    masked: Callable[[], Any] | None  # decode only
    max_abs_diff: float
    contiguous_impl: str


class _Data(NamedTuple):
    """K/V both ways, the step's query and new K/V, and its attention metadata."""

    k_cont: Any  # [B, Hkv, L, D]
    v_cont: Any
    k_cache: Any  # [num_blocks, block_size, Hkv, D]
    v_cache: Any
    tables: Any  # [B, blocks per request] int32
    q: Any  # decode [B, Hq, D]; prefill [L, Hq, D]
    k_new: Any  # decode [B, Hkv, D]; prefill [L, Hkv, D]
    v_new: Any
    meta: Any


def case(phase: str, batch: int, context: int, block_size: int, hq: int, hkv: int, d: int,
         backend_name: str, seed: int, device: str = "cpu", dtype: str = "float32",
         kv_dtype: str | None = None) -> Case:
    """The same attention step both ways (checked to agree), plus the CPU backend's gather and
    contiguous decode with a length mask. ``kv_dtype`` (int8 / fp8_*): the pool holds K/V
    quantized, the contiguous side the same values dequantized."""
    import torch

    from pagedllm.attention import get_backend
    from pagedllm.attention.quant import load_blocks

    if phase != "decode" and batch != 1:
        raise ValueError("prefill cases use one request")
    x = _data(phase, batch, context, block_size, hq, hkv, d, seed, device, getattr(torch, dtype),
              kv_dtype)
    backend = get_backend(backend_name, device)
    scale = d ** -0.5

    def paged() -> Any:
        return backend.forward(x.q, x.k_new, x.v_new, x.k_cache, x.v_cache, x.meta, scale)

    masked: Callable[[], Any] | None = None
    if phase == "decode":
        contiguous, masked = _contiguous_decode(x, batch, hq, hkv, d, scale, device)
        impl = "sdpa"
    else:
        contiguous, impl = _contiguous_prefill(x, hq // hkv, scale, device)
    gather: Callable[[], Any] | None = None
    if backend_name == "cpu":
        tables = x.tables.long()

        def gather() -> Any:  # what the CPU backend materialises before its SDPA call
            return load_blocks(x.k_cache, tables).float(), load_blocks(x.v_cache, tables).float()

    err = _check(paged, contiguous, phase, context, block_size, dtype)
    return Case(paged, contiguous, gather, masked, err, impl)


def _data(phase: str, batch: int, context: int, block_size: int, hq: int, hkv: int, d: int,
          seed: int, device: str, dt: Any, kv_dtype: str | None = None) -> _Data:
    """Random K/V of ``batch`` requests of ``context`` tokens, contiguous and scattered over a
    shuffled pool (one spare block); the step rewrites the last position (decode) or all of
    them (prefill). ``kv_dtype``: the pool quantized, the contiguous K/V its values."""
    import torch

    from pagedllm.attention import AttentionMetadata

    g = torch.Generator(device=device).manual_seed(seed)
    per_req = -(-context // block_size)
    nb = batch * per_req + 1
    k_cont = torch.randn(batch, hkv, context, d, generator=g, device=device, dtype=dt)
    v_cont = torch.randn(batch, hkv, context, d, generator=g, device=device, dtype=dt)
    perm = torch.randperm(nb, generator=g, device=device)[:batch * per_req]
    perm = perm.view(batch, per_req).to(torch.int32)  # [B, blocks per request]
    pos = torch.arange(context, device=device)
    slots = (perm.long()[:, pos // block_size] * block_size + pos % block_size)  # [B, L]
    k_cache, k_cont = _pool(k_cont, slots, nb, block_size, kv_dtype)
    v_cache, v_cont = _pool(v_cont, slots, nb, block_size, kv_dtype)
    if phase == "decode":
        q = torch.randn(batch, hq, d, generator=g, device=device, dtype=dt)
        k_new = k_cont[:, :, -1].clone()  # [B, Hkv, D]: rewrite the last position
        v_new = v_cont[:, :, -1].clone()
        qsl, lens, slot_map = list(range(batch + 1)), [context] * batch, slots[:, -1].contiguous()
    else:
        q = torch.randn(context, hq, d, generator=g, device=device, dtype=dt)
        k_new = k_cont[0].transpose(0, 1).clone()  # [L, Hkv, D]
        v_new = v_cont[0].transpose(0, 1).clone()
        qsl, lens, slot_map = [0, context], [context], slots[0].contiguous()
    meta = AttentionMetadata(
        slot_mapping=slot_map,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=perm,
        max_query_len=qsl[1] - qsl[0],
        max_seq_len=context,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=lens,
    )
    return _Data(k_cont, v_cont, k_cache, v_cache, perm, q, k_new, v_new, meta)


def _pool(cont: Any, slots: Any, nb: int, block_size: int, kv_dtype: str | None) -> tuple[Any, Any]:
    """(the pool [nb, block_size, Hkv, D] holding ``cont`` [B, Hkv, L, D] at ``slots`` [B, L],
    the contiguous K or V its values read back): plain, or quantized (``QuantizedKV``)."""
    import torch

    from pagedllm.attention.quant import QMAX, QUANT_DTYPES, QuantizedKV, dequantize, quantize

    b, hkv, length, d = cont.shape
    rows = cont.permute(0, 2, 1, 3).reshape(-1, hkv, d)  # [B*L, Hkv, D] in slot order
    if kv_dtype is None:
        pool = torch.zeros(nb, block_size, hkv, d, device=cont.device, dtype=cont.dtype)
        pool.view(-1, hkv, d)[slots.reshape(-1)] = rows
        return pool, cont
    qdt = QUANT_DTYPES[kv_dtype]
    q, scale = quantize(rows, qdt)
    # each row's largest value at the format's largest magnitude: then quantizing the values
    # read back gives these bits again (the step's rewrite of its rows then changes nothing)
    qf = q.float()
    top = qf.abs().argmax(dim=-1, keepdim=True)
    sign = torch.where(qf.gather(-1, top) < 0, -1.0, 1.0)
    q = qf.scatter(-1, top, sign * QMAX[qdt]).to(qdt)
    data = torch.zeros(nb, block_size, hkv, d, device=cont.device, dtype=torch.int8)
    data.view(-1, hkv, d)[slots.reshape(-1)] = q.view(torch.int8)  # fp8 as its bytes
    scales = torch.ones(nb, block_size, hkv, device=cont.device, dtype=scale.dtype)
    scales.view(-1, hkv)[slots.reshape(-1)] = scale
    back = dequantize(q, scale, cont.dtype).view(b, length, hkv, d).permute(0, 2, 1, 3)
    return QuantizedKV(data.view(qdt), scales), back.contiguous()


def _contiguous_decode(x: _Data, batch: int, hq: int, hkv: int, d: int, scale: float,
                       device: str) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """One SDPA call with the GQA group folded into the query axis, and the same with the
    length mask that a batch of ragged lengths needs."""
    import torch
    import torch.nn.functional as F

    group = hq // hkv
    keep = torch.ones(batch, 1, 1, x.k_cont.shape[2], dtype=torch.bool, device=device)

    def run(mask: Any) -> Any:
        x.k_cont[:, :, -1] = x.k_new
        x.v_cont[:, :, -1] = x.v_new
        qg = x.q.view(batch, hkv, group, d)
        return F.scaled_dot_product_attention(qg, x.k_cont, x.v_cont, attn_mask=mask,
                                              scale=scale).reshape(batch, hq, d)

    return (lambda: run(None)), (lambda: run(keep))


def _contiguous_prefill(x: _Data, group: int, scale: float,
                        device: str) -> tuple[Callable[[], Any], str]:
    """SDPA ``is_causal`` with GQA; on CUDA, where no fused kernel takes GQA at the dtype, K/V
    kept expanded to the query heads instead (``sdpa-expanded-kv``)."""
    import torch.nn.functional as F

    qi = x.q.transpose(0, 1).unsqueeze(0)  # [1, Hq, L, D]

    def contiguous() -> Any:
        x.k_cont[0] = x.k_new.transpose(0, 1)
        x.v_cont[0] = x.v_new.transpose(0, 1)
        o = F.scaled_dot_product_attention(qi, x.k_cont, x.v_cont, is_causal=True, scale=scale,
                                           enable_gqa=group > 1)
        return o[0].transpose(0, 1)

    impl = "sdpa-gqa" if group > 1 else "sdpa"
    if not is_cuda(device):
        return contiguous, impl
    # No fused CUDA kernel takes GQA at every dtype (flash: fp16/bf16 only), and SDPA would fall
    # back to its math kernel. Probe without that fallback; fused kernels outrank math in SDPA's
    # dispatch, so an untimed probe that passes here means the timed calls run fused too.
    try:
        with fused_sdpa_only(device):
            contiguous()
        return contiguous, impl
    except RuntimeError:
        pass
    k_exp = x.k_cont.repeat_interleave(group, dim=1)  # [1, Hq, L, D]
    v_exp = x.v_cont.repeat_interleave(group, dim=1)

    def expanded() -> Any:
        k_exp[0] = x.k_new.transpose(0, 1).repeat_interleave(group, dim=0)
        v_exp[0] = x.v_new.transpose(0, 1).repeat_interleave(group, dim=0)
        o = F.scaled_dot_product_attention(qi, k_exp, v_exp, is_causal=True, scale=scale)
        return o[0].transpose(0, 1)

    return expanded, "sdpa-expanded-kv"


def _check(paged: Callable[[], Any], contiguous: Callable[[], Any], phase: str, context: int,
           block_size: int, dtype: str) -> float:
    """The max abs difference of the two sides; AssertionError beyond ``TOLERANCE``."""
    import torch

    with torch.inference_mode():
        a, b = paged(), contiguous()
    diff = (a.reshape(b.shape).float() - b.float()).abs()
    atol, rtol = TOLERANCE[dtype]
    err = diff.max().item()
    if (diff - rtol * b.float().abs()).max().item() > atol:
        raise AssertionError(f"paged and contiguous attention disagree ({phase}, context "
                             f"{context}, block {block_size}, {dtype}): max abs diff {err:.2e} "
                             f"(tolerance {atol:g} + {rtol:g} x |contiguous|)")
    return float(err)


@contextlib.contextmanager
def fused_sdpa_only(device: str) -> Iterator[None]:
    """On CUDA, keep SDPA off its math fallback: for a long prefill it materialises the
    [Hq, L, L] score matrix (out of memory) and would not be a fair contiguous reference."""
    if not is_cuda(device):
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
    with sdpa_kernel([getattr(SDPBackend, n) for n in names if hasattr(SDPBackend, n)]):
        yield
