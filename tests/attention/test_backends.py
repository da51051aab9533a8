"""CpuBackend against TorchRefBackend on random paged batches (both decode paths: the C++ kernel
and the SDPA fallback), and write_kv slot placement."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm import kernels
from pagedllm.attention import AttentionBackend, AttentionMetadata, get_backend
from pagedllm.attention.cpu import CpuBackend
from pagedllm.attention.quant import QuantizedKV
from pagedllm.attention.torch_ref import TorchRefBackend

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def make_batch(
    reqs: list[tuple[int, int]], block_size: int, gen: torch.Generator, spare_blocks: int = 3
) -> tuple[AttentionMetadata, int]:
    """reqs = [(cached_len, query_len)]; each request gets its own random, non-contiguous blocks.

    Returns the metadata and the number of blocks the cache needs.
    """
    need = [-(-(c + n) // block_size) for c, n in reqs]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(need)
    tables = torch.zeros(len(reqs), max_blocks, dtype=torch.int32)
    slots: list[int] = []
    qsl = [0]
    for i, ((cached, n), nb) in enumerate(zip(reqs, need, strict=True)):
        blocks = [perm.pop() for _ in range(nb)]
        tables[i, :nb] = torch.tensor(blocks, dtype=torch.int32)
        slots += [
            blocks[p // block_size] * block_size + p % block_size for p in range(cached, cached + n)
        ]
        qsl.append(qsl[-1] + n)
    seq_lens = [c + n for c, n in reqs]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        max_query_len=max(n for _, n in reqs),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )
    return meta, num_blocks


META_TENSORS = ("slot_mapping", "query_start_loc", "seq_lens", "block_tables")


def forward_on(device: str, backend: AttentionBackend, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, kc: Any, vc: Any, meta: AttentionMetadata, scale: float,
               window: int | None = None) -> torch.Tensor:
    """``backend.forward`` with every tensor on ``device`` (the Triton backend on a GPU takes
    CUDA tensors only): the caches' new contents are copied back into ``kc`` / ``vc`` (plain or
    quantized), and the output comes back on the CPU."""
    if torch.device(device).type == "cpu":
        return backend.forward(q, k, v, kc, vc, meta, scale, window)
    moved = dataclasses.replace(meta, **{n: getattr(meta, n).to(device) for n in META_TENSORS})
    caches = [QuantizedKV(c.data.to(device), c.scale.to(device)) if isinstance(c, QuantizedKV)
              else c.to(device) for c in (kc, vc)]
    out = backend.forward(q.to(device), k.to(device), v.to(device), *caches, moved, scale, window)
    for host, dev in zip((kc, vc), caches):
        if isinstance(host, QuantizedKV):
            host.data.copy_(dev.data)
            host.scale.copy_(dev.scale)
        else:
            host.copy_(dev)
    return out.cpu()


def compare_with_torch_ref(
    backend: AttentionBackend,
    reqs: list[tuple[int, int]],
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    sliding_window: int | None,
    seed: int = 0,
    device: str = "cpu",
    tol: dict[torch.dtype, float] | None = None,
) -> None:
    """Same random paged batch through torch_ref (on CPU) and ``backend`` (on ``device``): same
    output within ``tol``, same caches after the write."""
    gen = torch.Generator().manual_seed(seed)
    meta, num_blocks = make_batch(reqs, block_size, gen)
    t = meta.num_tokens
    # q/k/v as slices of one fused projection, like the model's (non-contiguous rows).
    qkv = torch.randn(t, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    # Cached context (and stale data in unused slots) is random too.
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    kc = torch.randn(shape, generator=gen).to(dtype)
    vc = torch.randn(shape, generator=gen).to(dtype)
    kc2, vc2 = kc.clone(), vc.clone()  # the backend's (written back from ``device``)
    before = (kc.clone(), vc.clone())
    scale = head_dim**-0.5
    ref = TorchRefBackend().forward(q, k, v, kc, vc, meta, scale, sliding_window)
    out = forward_on(device, backend, q, k, v, kc2, vc2, meta, scale, sliding_window)
    assert out.dtype == dtype and out.shape == q.shape
    atol = (tol or TOL)[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=atol)
    # the backend's write, checked on its own (torch_ref and cpu share write_kv) ...
    assert_slots_hold(kc2, vc2, k, v, meta, before)
    # ... and the same caches as torch_ref's
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


# The CPU backend's two decode paths: the C++ kernel, and SDPA over gathered blocks (what runs
# where the kernel cannot be built).
PATHS = ["kernel", "sdpa"]


def require_kernels() -> None:
    """Kernel tests fail, not skip, when the kernels do not build (unless switched off)."""
    if os.environ.get("PAGEDLLM_CPU_KERNELS") == "0":
        pytest.skip("CPU kernels switched off by PAGEDLLM_CPU_KERNELS=0")
    assert kernels.available(), f"CPU kernels did not build: {kernels.unavailable_reason()}"


def cpu_backend(path: str) -> CpuBackend:
    if path == "kernel":
        require_kernels()
    return CpuBackend(use_kernel=path == "kernel")


def run_both(
    reqs: list[tuple[int, int]],
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    sliding_window: int | None,
    seed: int = 0,
    cpu: CpuBackend | None = None,
    path: str = "sdpa",
) -> None:
    compare_with_torch_ref(cpu or cpu_backend(path), reqs, block_size, num_heads, num_kv_heads,
                           head_dim, dtype, sliding_window, seed)


HEADS = [(4, 4), (4, 2), (8, 2), (16, 2), (8, 1)]  # GQA ratios 1, 2, 4, 8; MQA


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("block_size", [1, 2, 16, 64, 256])
def test_mixed_batch_fp32(path: str, num_heads: int, num_kv_heads: int, block_size: int) -> None:
    # prefill from scratch, prefill chunk after cached context, decodes, a long decode
    reqs = [(0, 7), (5, 1), (13, 4), (0, 1), (40, 1), (3, 1), (70, 9)]
    run_both(reqs, block_size, num_heads, num_kv_heads, 64, torch.float32, None, path=path)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("head_dim", [32, 64, 80, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_head_dims_and_dtypes(path: str, head_dim: int, dtype: torch.dtype) -> None:
    reqs = [(9, 6), (0, 1), (30, 1), (0, 12)]
    run_both(reqs, 16, 8, 2, head_dim, dtype, None, seed=head_dim, path=path)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [1, 3, 8, 100])
def test_sliding_window(path: str, block_size: int, window: int) -> None:
    reqs = [(0, 20), (17, 5), (25, 1), (2, 1), (50, 3)]
    run_both(reqs, block_size, 4, 2, 64, torch.float32, window, path=path)


def test_decode_groups_split() -> None:
    """SDPA path, small group budget: decode requests split into several batched calls."""
    cpu = CpuBackend(use_kernel=False)
    cpu.decode_group_bytes = 2 * 30 * 2 * 64 * 4
    reqs = [(c, 1) for c in (3, 29, 0, 11, 7, 28, 1)] + [(4, 3)] + [(c, 1) for c in (5, 6)]
    run_both(reqs, 4, 8, 2, 64, torch.float32, None, cpu=cpu)
    run_both(reqs, 4, 8, 2, 64, torch.float32, 5, cpu=cpu)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_equal_lengths(path: str, block_size: int, dtype: torch.dtype) -> None:
    """Equal decode lengths take the SDPA path's mask-free call: the gathered view is cut at
    max_len, so the random (stale) tail of each last block must not be read."""
    for reqs in ([(21, 1)] * 5, [(31, 1)] * 3, [(0, 1)] * 4):
        run_both(reqs, block_size, 8, 2, 64, dtype, None, path=path)


def test_decode_workspace_reused() -> None:
    """SDPA path: one backend across batches of growing and shrinking size (the decode gather
    workspace is reused and regrown), and with the workspace switched off (fresh gathers)."""
    cpu = CpuBackend(use_kernel=False)
    for reqs in ([(5, 1)] * 3, [(40, 1), (9, 1)] * 4, [(2, 1), (17, 1)], [(70, 1)] * 6):
        run_both(reqs, 16, 8, 2, 64, torch.float32, None, cpu=cpu)
    cpu.workspace_bytes = 0
    run_both([(40, 1), (9, 1)] * 4, 16, 8, 2, 64, torch.float32, None, cpu=cpu)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_decode_window_skips_blocks(path: str, window: int) -> None:
    """Sliding-window decode starts at the first block any request still sees."""
    reqs = [(c, 1) for c in (60, 44, 63, 50, 61)]
    run_both(reqs, 4, 8, 2, 64, torch.float32, window, path=path)


@settings(max_examples=25, deadline=None)
@given(
    reqs=st.lists(
        st.tuples(st.integers(0, 60), st.sampled_from([1, 1, 1, 2, 5, 17])), min_size=1, max_size=6
    ),
    block_size=st.sampled_from([1, 2, 16, 64, 256]),
    heads=st.sampled_from(HEADS),
    head_dim=st.sampled_from([64, 80, 128]),
    window=st.sampled_from([None, None, 1, 6, 32]),
    seed=st.integers(0, 2**16),
    path=st.sampled_from(PATHS),
)
def test_random_batches(
    reqs: list[tuple[int, int]],
    block_size: int,
    heads: tuple[int, int],
    head_dim: int,
    window: int | None,
    seed: int,
    path: str,
) -> None:
    run_both(reqs, block_size, heads[0], heads[1], head_dim, torch.float32, window, seed=seed,
             path=path)


def assert_slots_hold(kc: torch.Tensor, vc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      meta: AttentionMetadata,
                      before: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """New row j (request i, position p) sits at block_tables[i, p // bs], offset p % bs, and
    every other slot still holds what it held ``before`` (default: zero-initialised caches)."""
    num_blocks, block_size, hkv, d = kc.shape
    row = 0
    qsl = meta.query_start_loc_cpu
    for i in range(meta.num_reqs):
        for p in range(meta.seq_lens_cpu[i] - (qsl[i + 1] - qsl[i]), meta.seq_lens_cpu[i]):
            block = int(meta.block_tables[i, p // block_size])
            assert torch.equal(kc[block, p % block_size], k[row])
            assert torch.equal(vc[block, p % block_size], v[row])
            row += 1
    assert row == meta.num_tokens
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[meta.slot_mapping] = True
    k0, v0 = before if before is not None else (torch.zeros_like(kc), torch.zeros_like(vc))
    for cache, old in ((kc, k0), (vc, v0)):
        assert torch.equal(cache.view(-1, hkv, d)[~written], old.view(-1, hkv, d)[~written])


@pytest.mark.parametrize("backend", ["torch_ref", "cpu"])
def test_write_kv_slots(backend: str) -> None:
    gen = torch.Generator().manual_seed(1)
    block_size, hkv, d = 4, 2, 8
    meta, num_blocks = make_batch([(3, 6), (0, 1), (9, 1)], block_size, gen)
    t = meta.num_tokens
    q = torch.randn(t, 4, d, generator=gen)
    k = torch.randn(t, hkv, d, generator=gen)
    v = torch.randn(t, hkv, d, generator=gen)
    kc = torch.zeros(num_blocks, block_size, hkv, d)
    vc = torch.zeros_like(kc)
    get_backend(backend, "cpu").forward(q, k, v, kc, vc, meta, d**-0.5)
    assert_slots_hold(kc, vc, k, v, meta)


def test_registry() -> None:
    assert get_backend(None, "cpu").name == "cpu"
    assert isinstance(get_backend("torch_ref", "cpu"), TorchRefBackend)
    with pytest.raises(ValueError, match="cpu.*torch_ref"):
        get_backend("nope", "cpu")
