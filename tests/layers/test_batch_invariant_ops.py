"""The kernels batch-invariant mode relies on, one by one: a row's bits do not depend on the other
rows of the call (pagedllm's GEMM at any row count and width, the paged attention kernel over
any chunking of a prompt with ``fixed_tiles``, the torch ops the sampler runs per row).
The engine-level checks are tests/golden/test_batch_invariant.py."""

from __future__ import annotations

import pytest
import torch

from pagedllm import kernels
from pagedllm.layers.linear import Linear, gemm_dtypes, pack_batch_invariant

pytestmark = pytest.mark.skipif(not kernels.available(), reason="pagedllm CPU kernels unavailable")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(500, 72), (96, 257), (7, 33)])
def test_gemm_row_bits_do_not_depend_on_the_rows(dtype: torch.dtype, n: int, k: int) -> None:
    if dtype not in gemm_dtypes():
        pytest.skip(f"pagedllm's GEMM does not run {dtype} here")
    gen = torch.Generator().manual_seed(n + k)
    lin = Linear(k, n, bias=True).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=gen))
        lin.bias.copy_(torch.randn(n, generator=gen))
    assert pack_batch_invariant(lin) == 0 and lin.kind == "gemm"
    x = torch.randn(130, k, generator=gen).to(dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    with torch.inference_mode():
        alone = torch.cat([lin(x[i : i + 1]) for i in range(x.shape[0])]).view(bits)
        for m in (1, 2, 7, 8, 9, 17, 64, 65, 130):  # every register-tile height and M chunk
            assert torch.equal(lin(x[:m]).view(bits), alone[:m]), f"{m} rows"


def _attend(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, table: torch.Tensor,
            chunks: list[tuple[int, int]], window: int | None, fixed: bool) -> torch.Tensor:
    """Rows [a, b) of one request's prompt for each (a, b) in ``chunks``, each chunk in its own
    call beside a decode request of another length; the prompt's rows, concatenated."""
    outs = []
    for a, b in chunks:
        rows = torch.cat([q[a:b], q[:1]])  # the other request: one decode token at position 90
        tables = torch.stack([table, table.flip(0)])
        lens = torch.tensor([b, 91], dtype=torch.int32)
        qsl = torch.tensor([0, b - a, b - a + 1], dtype=torch.int32)
        out = torch.empty_like(rows)
        torch.ops.pagedllm.paged_attention(rows, kc, None, vc, None, tables, lens, qsl, out,
                                           0.25, window, rows.shape[0], fixed)
        outs.append(out[: b - a])
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 100, 37])
def test_attention_rows_do_not_depend_on_the_chunking(dtype: torch.dtype, window: int | None) -> None:
    gen = torch.Generator().manual_seed(3)
    length, bs, hq, hkv, d = 200, 16, 8, 2, 32
    nb = length // bs + 1
    q = torch.randn(length, hq, d, generator=gen).to(dtype)
    kc = torch.randn(nb, bs, hkv, d, generator=gen).to(dtype)
    vc = torch.randn(nb, bs, hkv, d, generator=gen).to(dtype)
    table = torch.randperm(nb, generator=gen).to(torch.int32)
    one = _attend(q, kc, vc, table, [(0, length)], window, True)
    for cuts in ([0, 37, 90, 91, 150, 199, 200], [0, 64, 128, 200], [0, 1, 2, 130, 200]):
        chunks = list(zip(cuts[:-1], cuts[1:]))
        assert torch.equal(_attend(q, kc, vc, table, chunks, window, True), one), cuts
    decode = _attend(q, kc, vc, table, [(p, p + 1) for p in range(length - 70, length)], window,
                     True)
    assert torch.equal(decode, one[-70:])
    if window == 100:  # without the fixed grid a chunk's tiles start at its window: other bits
        moved = _attend(q, kc, vc, table, [(0, 37), (37, 200)], window, False)
        assert not torch.equal(moved, _attend(q, kc, vc, table, [(0, length)], window, False))


def test_sampler_row_ops_do_not_depend_on_the_rows() -> None:
    """What the sampler computes per row on CPU (softmax, log_softmax, sort, cumsum, argmax,
    division by a per-row temperature): a row of a [64, V] batch has the bits it has alone."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 4999, generator=gen) * 4
    temp = torch.rand(64, generator=gen) + 0.5
    ops = {
        "softmax": lambda x, t: x.softmax(-1),
        "log_softmax": lambda x, t: x.log_softmax(-1),
        "scaled softmax": lambda x, t: (x / t.unsqueeze(1)).softmax(-1),
        "sort": lambda x, t: x.sort(-1, descending=True)[0],
        "cumsum": lambda x, t: x.softmax(-1).cumsum(-1),
        "argmax": lambda x, t: x.argmax(-1),
    }
    for name, op in ops.items():
        batch = op(logits, temp)
        for i in (0, 17, 63):
            assert torch.equal(op(logits[i : i + 1], temp[i : i + 1])[0], batch[i]), name
