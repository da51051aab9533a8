"""Every backend on block tables as a sliding-window KV manager makes them: blocks wholly before
a request's window are freed (their entries name the request's first held block) and rows are
padded with their last block. Every block no request holds is filled with NaN (and NaN scales,
for quantized caches): outputs must equal torch_ref's over intact caches, so nothing of a freed
block leaks through the masking, whatever it holds. The CPU backend runs both decode paths (the
C++ kernel reads only its window's positions; the SDPA path gathers a fixed span and relies on
the tables naming the request's own blocks)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

import pytest  # noqa: E402
import torch  # noqa: E402
from test_backends import TOL, forward_on, make_batch  # noqa: E402

from pagedllm import kernels  # noqa: E402
from pagedllm.attention import AttentionBackend, AttentionMetadata  # noqa: E402
from pagedllm.attention.cpu import CpuBackend  # noqa: E402
from pagedllm.attention.quant import QUANT_DTYPES, QuantizedKV, quantize, raw  # noqa: E402
from pagedllm.attention.torch_ref import TorchRefBackend  # noqa: E402
from pagedllm.kv.window import SlidingWindow  # noqa: E402

# (cached, new): decodes far past the window, a chunk after cached context, a fresh prefill
REQS = [(70, 1), (5, 1), (41, 1), (33, 9), (0, 12), (90, 1), (18, 3)]


def backends() -> list[str]:
    names = ["torch_ref", "cpu-sdpa"] + (["cpu-kernel"] if kernels.available() else [])
    try:
        from pagedllm.attention.triton import common
    except ImportError:
        return names
    return names + (["triton"] if common.INTERPRET or torch.cuda.is_available() else [])


def _interpret() -> bool:
    from pagedllm.attention.triton import common

    return common.INTERPRET


def make_backend(name: str) -> AttentionBackend:
    if name == "triton":
        from pagedllm.attention.triton import TritonBackend

        return TritonBackend()
    if name.startswith("cpu"):
        return CpuBackend(use_kernel=name == "cpu-kernel")
    return TorchRefBackend()


def window_tables(meta: AttentionMetadata, reqs: list[tuple[int, int]], block_size: int,
                  window: int) -> tuple[torch.Tensor, set[int]]:
    """The manager's tables for ``meta``'s requests (placeholders, own-block padding) and the
    blocks they hold."""
    w = SlidingWindow(window, block_size)
    tables = meta.block_tables.clone()
    held: set[int] = set()
    for i, (cached, n) in enumerate(reqs):
        k, nb = w.first_needed_block(cached), -(-(cached + n) // block_size)
        row = tables[i, :nb].tolist()
        held.update(row[k:])
        tables[i, :k] = row[k]
        tables[i, nb:] = row[-1]
    return tables, held


def poison(cache: torch.Tensor | QuantizedKV, keep: set[int]) -> None:
    gone = [b for b in range(cache.shape[0]) if b not in keep]
    if isinstance(cache, QuantizedKV):
        cache.scale[gone] = float("nan")
        if cache.data.dtype == torch.float8_e4m3fn:
            raw(cache.data)[gone] = 0x7F  # NaN in e4m3fn
    else:
        cache[gone] = float("nan")


@pytest.mark.parametrize("name", backends())
@pytest.mark.parametrize("block_size,window", [(1, 3), (4, 8), (16, 3), (16, 32)])
@pytest.mark.parametrize("kv", ["float32", "bfloat16", "int8", "fp8_e4m3"])
def test_freed_blocks_never_leak(name: str, block_size: int, window: int, kv: str) -> None:
    gen = torch.Generator().manual_seed(block_size * 100 + window)
    meta, num_blocks = make_batch(REQS, block_size, gen)
    num_heads, num_kv_heads, head_dim = 8, 2, 32
    dtype = torch.bfloat16 if kv == "bfloat16" else torch.float32
    t = meta.num_tokens
    q = torch.randn(t, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(t, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(t, num_kv_heads, head_dim, generator=gen).to(dtype)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)

    def cache() -> torch.Tensor | QuantizedKV:
        x = torch.randn(shape, generator=gen)
        if kv in QUANT_DTYPES:
            return QuantizedKV(*quantize(x, QUANT_DTYPES[kv]))
        return x.to(dtype)

    def clone(c: torch.Tensor | QuantizedKV) -> torch.Tensor | QuantizedKV:
        return QuantizedKV(c.data.clone(), c.scale.clone()) if isinstance(c, QuantizedKV) \
            else c.clone()

    kc, vc = cache(), cache()
    scale = head_dim**-0.5
    # the truth: intact caches, the full tables (the window mask alone hides the old blocks)
    ref = TorchRefBackend().forward(q, k, v, clone(kc), clone(vc), meta, scale, window)
    tables, held = window_tables(meta, REQS, block_size, window)
    kp, vp = clone(kc), clone(vc)
    poison(kp, held)
    poison(vp, held)
    meta.block_tables = tables
    device = "cuda" if name == "triton" and not _interpret() else "cpu"
    out = forward_on(device, make_backend(name), q, k, v, kp, vp, meta, scale, window)
    assert torch.isfinite(out.float()).all(), f"{name}: a freed block leaked"
    tol = TOL[dtype] if name != "triton" else max(TOL[dtype], 2e-5)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
