"""TritonBackend(batch_invariant=True): every query token through the decode kernel with splits of
a fixed length, so a prompt token has the same bits computed in one prefill, in chunks of any
size beside another request, or as a decode step; and the output matches torch_ref. In Triton's
interpreter on CPU tensors (compiled on a GPU where there is one)."""

from __future__ import annotations

from triton_env import DEVICE  # first: sets TRITON_INTERPRET before triton is imported

# isort: split
import textwrap

import pytest
import torch
from aot_compile import compile_kernels
from test_backends import forward_on

from pagedllm.attention import AttentionMetadata, get_backend
from pagedllm.attention.torch_ref import TorchRefBackend
from pagedllm.attention.triton import TritonBackend

LENGTH, BS, HQ, HKV, D = 150, 16, 4, 1, 32
SPLIT = 64  # keys per decode split here (the mode's 256 would be one split at this length)
OTHER_LEN = 61  # the other request: one decode token at this length


class Prompt:
    """One request's prompt (q, k, v per position) in a paged cache, and another request beside
    it: its own blocks, one decode token. The caches start with every position written, so a
    chunk's earlier positions are there whatever ran before."""

    def __init__(self, dtype: torch.dtype) -> None:
        gen = torch.Generator().manual_seed(7)
        nb = LENGTH // BS + 1
        self.q, self.k, self.v = (torch.randn(LENGTH, h, D, generator=gen).to(dtype)
                                  for h in (HQ, HKV, HKV))
        self.other = [torch.randn(1, h, D, generator=gen).to(dtype) for h in (HQ, HKV, HKV)]
        perm = torch.randperm(2 * nb, generator=gen).to(torch.int32)
        self.tables = torch.stack([perm[:nb], perm[nb:]])
        self.kc, self.vc = (torch.randn(2 * nb, BS, HKV, D, generator=gen).to(dtype)
                            for _ in range(2))
        for p in range(LENGTH):
            b, o = int(self.tables[0, p // BS]), p % BS
            self.kc[b, o], self.vc[b, o] = self.k[p], self.v[p]

    def slot(self, req: int, pos: int) -> int:
        return int(self.tables[req, pos // BS]) * BS + pos % BS

    def run(self, backend: TritonBackend | TorchRefBackend, chunks: list[tuple[int, int]],
            window: int | None) -> torch.Tensor:
        """Positions [a, b) of the prompt for each (a, b) in ``chunks``, each chunk a step of its
        own beside the other request's decode token; the prompt's rows, concatenated."""
        outs = []
        for a, b in chunks:
            n = b - a
            qsl, lens = [0, n, n + 1], [b, OTHER_LEN]
            meta = AttentionMetadata(
                slot_mapping=torch.tensor([self.slot(0, p) for p in range(a, b)]
                                          + [self.slot(1, OTHER_LEN - 1)]),
                query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=self.tables,
                max_query_len=n, max_seq_len=max(lens), query_start_loc_cpu=qsl,
                seq_lens_cpu=lens)
            q, k, v = (torch.cat([t[a:b], o]) for t, o in zip((self.q, self.k, self.v), self.other))
            outs.append(forward_on(DEVICE, backend, q, k, v, self.kc, self.vc, meta, 0.25,
                                   window)[:n])
        return torch.cat(outs)


@pytest.mark.parametrize("dtype,window", [
    (torch.float32, 50),
    pytest.param(torch.float32, None, marks=pytest.mark.slow),
    pytest.param(torch.float16, None, marks=pytest.mark.slow),
    pytest.param(torch.float16, 50, marks=pytest.mark.slow)])
def test_a_token_has_the_same_bits_in_any_chunk(dtype: torch.dtype, window: int | None) -> None:
    prompt = Prompt(dtype)
    backend = get_backend("triton", DEVICE, batch_invariant=True)
    assert isinstance(backend, TritonBackend) and backend.decode_split_len is not None
    backend.decode_split_len = SPLIT
    one = prompt.run(backend, [(0, LENGTH)], window)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for cuts in ([0, 37, 64, 65, 129, LENGTH], [0, 1, 2, 100, LENGTH]):
        got = prompt.run(backend, list(zip(cuts[:-1], cuts[1:])), window)
        assert torch.equal(got.view(bits), one.view(bits)), cuts
    decode = prompt.run(backend, [(p, p + 1) for p in range(LENGTH - 6, LENGTH)], window)
    assert torch.equal(decode.view(bits), one[-6:].view(bits))
    ref = prompt.run(TorchRefBackend(), [(0, LENGTH)], window)
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(one.float(), ref.float(), atol=tol, rtol=tol)


def test_the_default_mode_gives_other_bits_as_decode_steps() -> None:
    """Without the mode a prompt runs the prefill kernel and a decode token the decode kernel,
    with splits chosen from the batch: the check above can tell."""
    prompt = Prompt(torch.float32)
    backend = TritonBackend()
    backend.decode_min_split_len = SPLIT
    one = prompt.run(backend, [(0, LENGTH)], 50)
    decode = prompt.run(backend, [(p, p + 1) for p in range(LENGTH - 6, LENGTH)], 50)
    assert not torch.equal(decode, one[-6:])


@pytest.mark.slow
def test_invariant_kernels_compile_for_gpu() -> None:
    """The mode's own kernels (layers/triton_invariant.py) compiled ahead of time for sm_80 and
    sm_90, every dtype and switch, within the shared-memory budget (the attention kernels it
    runs are compiled in test_triton.py)."""
    compile_kernels(textwrap.dedent("""
        from pagedllm.layers import triton_invariant as ti
        for arch in (80, 90):
            for dt in ("fp32", "bf16", "fp16"):
                up = dt == "fp32"
                for bias in (False, True):
                    compile_for(ti._matmul_kernel, {p: "*" + dt for p in
                                ("x_ptr", "w_ptr", "b_ptr", "y_ptr")},
                                dict(HAS_BIAS=bias, UPCAST=up, PRECISION="ieee" if up else "tf32",
                                     ROUND=False, BLOCK_M=64, BLOCK_N=64, BLOCK_K=32), arch)
                for add in (False, True):
                    compile_for(ti._rms_norm_kernel, {p: "*" + dt for p in
                                ("x_ptr", "r_ptr", "w_ptr", "y_ptr")},
                                dict(ADD=add, ROUND=False, BLOCK=4096), arch, floats=("eps",))
                for log in (False, True):
                    compile_for(ti._softmax_kernel, {"x_ptr": "*" + dt, "y_ptr": "*fp32"},
                                dict(LOG=log, BLOCK=ti.SOFTMAX_BLOCK), arch)
        print("compiled")
        """))
