"""TritonBackend against TorchRefBackend, run on CPU tensors in Triton's interpreter.

TRITON_INTERPRET must be set before triton is first imported (``@triton.jit`` picks the
interpreter at decoration time). The default suite runs a handful of representative shapes; the
full matrix (GQA x block sizes x head dims x dtypes, windows, random batches, compiling the
kernels for sm_80/sm_90, the engine end to end) is marked slow: ``pytest -m slow``.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import sys  # noqa: E402
import textwrap  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install 'pagedllm[cuda]')")

from aot_compile import compile_kernels  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_backends import (  # noqa: E402
    HEADS,
    TOL,
    assert_slots_hold,
    compare_with_torch_ref,
    forward_on,
    make_batch,
)

from pagedllm.attention import get_backend, registry  # noqa: E402
from pagedllm.attention.triton import TritonBackend, common  # noqa: E402
from pagedllm.attention.triton.decode import DecodeSplits, decode_tile_n  # noqa: E402
from pagedllm.attention.triton.kv_write import write_kv  # noqa: E402

if not common.INTERPRET and not torch.cuda.is_available():
    pytest.skip(
        "triton was imported without TRITON_INTERPRET=1 and there is no GPU",
        allow_module_level=True,
    )
DEVICE = "cpu" if common.INTERPRET else "cuda"
# A NaN/overflow warning from the interpreter means some lane read memory it should not have.
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")
# The interpreter's fp32 dots are exact fp32 (numpy); fp16/bf16 as for the CPU backend.
TRITON_TOL = {**TOL, torch.float32: 2e-5}


def run_both(
    reqs: list[tuple[int, int]],
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    sliding_window: int | None = None,
    seed: int = 0,
    min_split_len: int | None = None,
) -> None:
    """Same random paged batch through torch_ref and triton: same output, same caches."""
    backend = TritonBackend()
    if min_split_len is not None:
        backend.decode_min_split_len = min_split_len
    compare_with_torch_ref(backend, reqs, block_size, num_heads, num_kv_heads, head_dim, dtype,
                           sliding_window, seed, DEVICE, TRITON_TOL)


# prefill from scratch, a chunk after cached context, decodes (one at position 0), long ones
MIXED = [(0, 7), (5, 1), (13, 4), (0, 1), (40, 1), (3, 1), (70, 9)]


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,block_size,head_dim,dtype",
    [
        (4, 4, 16, 64, torch.float32),  # MHA, tiles span several blocks
        (8, 2, 32, 80, torch.float16),  # GQA 4, non-pow2 head dim
        (16, 2, 256, 64, torch.float32),  # GQA 8, a tile inside one large block
        (8, 1, 64, 128, torch.float16),  # MQA
    ],
)
def test_mixed_batch(
    num_heads: int, num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype
) -> None:
    run_both(MIXED, block_size, num_heads, num_kv_heads, head_dim, dtype, seed=block_size)


def test_split_k_decode() -> None:
    """Long decodes with several splits, ragged so some splits of short requests are empty."""
    reqs = [(299, 1), (3, 1), (150, 1), (64, 1), (191, 1), (20, 6)]
    tile = decode_tile_n(64)
    splits = DecodeSplits.choose(5, 2, 300, tile, target_programs=256, min_split_len=64)
    assert splits.num_splits >= 3 and splits.split_len % tile == 0
    run_both(reqs, 16, 8, 2, 64, torch.float32, min_split_len=64)
    run_both(reqs, 32, 8, 2, 80, torch.float16, sliding_window=70, min_split_len=64, seed=1)


def _decode_rows(backend: TritonBackend, reqs: list[tuple[int, int]], pick: list[int],
                 window: int | None) -> torch.Tensor:
    """``backend``'s output rows for the decode requests ``pick`` of the batch ``reqs``, run
    together, and each alone (the same q, K/V and blocks): [2, len(pick), Hq, D]."""
    import dataclasses

    gen = torch.Generator().manual_seed(4)
    meta, num_blocks = make_batch(reqs, 16, gen)
    q, k, v = (torch.randn(meta.num_tokens, h, 32, generator=gen) for h in (8, 2, 2))
    kc, vc = (torch.randn(num_blocks, 16, 2, 32, generator=gen) for _ in range(2))
    together = forward_on(DEVICE, backend, q, k, v, kc, vc, meta, 0.2, window)
    rows, alone = [meta.query_start_loc_cpu[i] for i in pick], []
    for i, r in zip(pick, rows):
        one = dataclasses.replace(
            meta, slot_mapping=meta.slot_mapping[r : r + 1],
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
            seq_lens=meta.seq_lens[i : i + 1], block_tables=meta.block_tables[i : i + 1],
            max_query_len=1, max_seq_len=meta.seq_lens_cpu[i], query_start_loc_cpu=[0, 1],
            seq_lens_cpu=meta.seq_lens_cpu[i : i + 1])
        alone.append(forward_on(DEVICE, backend, q[r : r + 1], k[r : r + 1], v[r : r + 1], kc, vc,
                                one, 0.2, window)[0])
    return torch.stack([together[rows], torch.stack(alone)])


@pytest.mark.parametrize("window", [None, 150])
def test_fixed_split_decode_is_batch_invariant(window: int | None) -> None:
    """``decode_split_len``: a decode row has the same bits alone and beside 15 other rows of
    other lengths (whose longest sets the grid), fp32. Splits chosen from the batch do not."""
    reqs = [(c, 1) for c in (40, 299, 700, 5, 130, 64, 511, 1, 90, 300, 255, 17, 420, 63, 2, 33)]
    pick = [1, 4, 9, 10, 15]  # 10 (256 keys): 4 splits of 64 alone, 2 of 128 in the batch
    backend = TritonBackend()
    backend.decode_min_split_len = 64
    chosen = _decode_rows(backend, reqs, pick, window)
    assert not torch.equal(chosen[0], chosen[1])  # the test can tell
    backend.decode_split_len = 128
    together, alone = _decode_rows(backend, reqs, pick, window)
    assert torch.equal(together, alone)
    compare_with_torch_ref(backend, reqs[:6], 16, 8, 2, 32, torch.float32, window, 1, DEVICE,
                           TRITON_TOL)


@pytest.mark.parametrize("window", [1, 8, 33])
def test_sliding_window(window: int) -> None:
    reqs = [(0, 20), (17, 5), (25, 1), (2, 1), (90, 70)]
    run_both(reqs, 16, 4, 2, 64, torch.float32, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_slots(dtype: torch.dtype) -> None:
    """Every new row lands exactly at block_tables[i, p // bs], offset p % bs; nothing else moves."""
    gen = torch.Generator().manual_seed(1)
    block_size, hkv, d = 4, 3, 80  # non-pow2 heads and head dim: masked tiles
    meta, num_blocks = make_batch([(3, 6), (0, 1), (9, 1), (0, 5)], block_size, gen)
    t = meta.num_tokens
    kv = torch.randn(t, 2 * hkv, d, generator=gen).to(dtype)
    k, v = kv[:, :hkv], kv[:, hkv:]  # non-contiguous rows
    kc = torch.zeros(num_blocks, block_size, hkv, d, dtype=dtype, device=DEVICE)
    vc = torch.zeros_like(kc)
    write_kv(k.to(DEVICE), v.to(DEVICE), kc, vc, meta.slot_mapping.to(DEVICE))
    assert_slots_hold(kc.cpu(), vc.cpu(), k, v, meta)


def test_registry() -> None:
    assert isinstance(get_backend("triton", DEVICE), TritonBackend)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without a GPU")
def test_no_gpu_and_no_interpreter_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "INTERPRET", False)
    with pytest.raises(ValueError, match="CUDA GPU.*TRITON_INTERPRET=1"):
        TritonBackend()


def test_missing_triton_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    for name in [m for m in sys.modules if m.startswith("pagedllm.attention.triton")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "triton", None)  # "import triton" raises ImportError
    with pytest.raises(ImportError, match=r'pip install "pagedllm\[cuda\]"'):
        importlib.import_module("pagedllm.attention.triton")
    monkeypatch.delitem(registry._BACKENDS, "triton")
    with pytest.raises(ValueError, match=r'pip install "pagedllm\[cuda\]"'):
        get_backend("triton", "cuda")


# ---------------------------------------------------------------------------------- slow matrix


@pytest.mark.slow
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("block_size", [1, 4, 16, 32, 64, 128, 256])
def test_gqa_and_block_sizes(num_heads: int, num_kv_heads: int, block_size: int) -> None:
    run_both(MIXED, block_size, num_heads, num_kv_heads, 64, torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_head_dims_and_dtypes(head_dim: int, dtype: torch.dtype) -> None:
    reqs = [(9, 6), (0, 1), (30, 1), (0, 12), (100, 1)]
    run_both(reqs, 16, 8, 2, head_dim, dtype, seed=head_dim, min_split_len=32)


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("window", [1, 3, 8, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sliding_window_matrix(block_size: int, window: int, dtype: torch.dtype) -> None:
    reqs = [(0, 20), (17, 5), (25, 1), (2, 1), (50, 3), (200, 1)]
    run_both(reqs, block_size, 8, 2, 80, dtype, window, min_split_len=64)


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(
    reqs=st.lists(
        st.tuples(st.integers(0, 150), st.sampled_from([1, 1, 1, 2, 5, 17, 70])),
        min_size=1,
        max_size=6,
    ),
    block_size=st.sampled_from([1, 16, 32, 64, 256]),
    heads=st.sampled_from(HEADS),
    head_dim=st.sampled_from([64, 80, 128]),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    window=st.sampled_from([None, None, 1, 6, 32]),
    min_split_len=st.sampled_from([64, 256]),
    seed=st.integers(0, 2**16),
)
def test_random_batches(
    reqs: list[tuple[int, int]],
    block_size: int,
    heads: tuple[int, int],
    head_dim: int,
    dtype: torch.dtype,
    window: int | None,
    min_split_len: int,
    seed: int,
) -> None:
    run_both(reqs, block_size, heads[0], heads[1], head_dim, dtype, window, seed, min_split_len)


@pytest.mark.slow
def test_engine_greedy_matches_cpu(tiny_models: dict[str, Path]) -> None:
    """The whole engine with the triton backend (interpreted) gives the cpu backend's tokens."""
    from pagedllm import LLM, SamplingParams

    if not common.INTERPRET:
        pytest.skip("the CPU engine path runs the triton backend only under TRITON_INTERPRET=1")
    prompts = ["t5 t6 t7 t8 t9 t10 t11 t12 t13", "t9 t9", "t40 " * 30, "t7"]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for backend in ("cpu", "triton"):
        llm = LLM(
            model=str(tiny_models["llama"]),
            block_size=16,
            num_kv_blocks=64,
            max_model_len=256,
            max_num_batched_tokens=32,  # chunked prefill mixed with decodes
            attention_backend=backend,
        )
        assert llm.engine.runner.backend.name == backend
        res = llm.generate(prompts, sp, use_tqdm=False)
        outs[backend] = [r.outputs[0].token_ids for r in res]
    assert outs["triton"] == outs["cpu"]


@pytest.mark.slow
def test_engine_decode_graph_path_matches_cpu(tiny_models: dict[str, Path]) -> None:
    """Decode steps through the CUDA-graph static buffers (not recorded: no GPU here) with the
    triton backend: grid sized from max_model_len (empty splits), padded rows, int32 casts."""
    from pagedllm import LLM, SamplingParams

    if not common.INTERPRET:
        pytest.skip("the CPU engine path runs the triton backend only under TRITON_INTERPRET=1")
    prompts = ["t5 t6 t7 t8 t9 t10 t11 t12 t13", "t9 t9", "t40 " * 30]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    kw = dict(model=str(tiny_models["llama"]), block_size=16, num_kv_blocks=64, max_model_len=256,
              max_num_seqs=4)
    want = [r.outputs[0].token_ids for r in LLM(**kw).generate(prompts, sp, use_tqdm=False)]
    llm = LLM(attention_backend="triton", **kw)
    backend = llm.engine.runner.backend
    assert isinstance(backend, TritonBackend)
    backend.decode_min_split_len = 32  # 4 splits of 64 keys (one tile), most of them empty
    graphs = llm.engine.runner.enable_decode_graphs(capture=False)
    got = [r.outputs[0].token_ids for r in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == want
    assert graphs.replays > 0


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_engine_with_triton_and_decode_graphs_matches_hf(tiny_models: dict[str, Path],
                                                         arch: str) -> None:
    """The engine as it runs on a GPU — triton backend, decode steps through the graph runner's
    static buffers — against HF transformers directly: greedy tokens equal, logprobs within 1e-4."""
    import random

    from transformers import AutoModelForCausalLM

    from pagedllm import LLM, SamplingParams

    if not common.INTERPRET:
        pytest.skip("the CPU engine path runs the triton backend only under TRITON_INTERPRET=1")
    rng = random.Random(3)
    prompts = [[rng.randrange(4, 512) for _ in range(n)] for n in (1, 7, 16, 33, 90)]
    n_new = 8
    llm = LLM(model=str(tiny_models[arch]), attention_backend="triton", block_size=16,
              num_kv_blocks=64, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)
    graphs = llm.engine.runner.enable_decode_graphs(capture=False)
    sp = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(tiny_models[arch], dtype=torch.float32).eval()
    assert len(outs) == len(prompts)
    for p, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=n_new, do_sample=False, eos_token_id=None,
                              pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        ids = ref.sequences[0, len(p):].tolist()
        lps = torch.cat(ref.logits).float().log_softmax(-1)
        comp = out.outputs[0]
        assert len(ids) == n_new and comp.token_ids == ids
        assert comp.logprobs is not None
        for step, tok in enumerate(ids):
            assert abs(comp.logprobs[step][tok].logprob - lps[step, tok].item()) < 1e-4
    assert graphs.replays > 0
    llm.engine.check_integrity()


_COMPILE_BODY = textwrap.dedent(
    """
    for arch, dt, d, group, bs in [
        (90, "fp16", 128, 8, 16), (90, "bf16", 80, 4, 256), (90, "fp32", 256, 1, 32),
        (80, "fp16", 256, 8, 16), (80, "bf16", 64, 1, 128),
    ]:
        upcast = dt == "fp32"
        prec = "ieee" if upcast else "tf32"
        bd = triton.next_power_of_2(d)
        data = {n: "*" + dt for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
        for split in (False, True):
            ptrs = {**data, "out_ptr": "*fp32", "lse_ptr": "*fp32"} if split else data
            compile_for(decode._decode_kernel, ptrs, dict(
                GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=bs,
                TILE_N=decode.decode_tile_n(d), BLOCK_D=bd, USE_WINDOW=split, SPLIT=split,
                DOT_FP32=upcast, PRECISION=prec), arch)
        for in_order in (False, True):
            compile_for(decode._merge_kernel, {"out_ptr": "*" + dt, "part_ptr": "*fp32",
                        "lse_ptr": "*fp32"}, dict(SPLITS_PAD=16, BLOCK_D=bd, IN_ORDER=in_order),
                        arch)
        bm, tn = prefill.prefill_tiles(d, group)
        compile_for(prefill._prefill_kernel, data, dict(
            GROUP=group, BLOCK_M=bm, BLOCK_Q=bm // group, BLOCK_SIZE=bs, TILE_N=tn, BLOCK_D=bd,
            USE_WINDOW=group == 4, DOT_FP32=upcast, PRECISION=prec), arch)
        compile_for(kv_write._kv_write_kernel, {"k_ptr": "*" + dt, "v_ptr": "*" + dt,
                    "k_cache_ptr": "*" + dt, "v_cache_ptr": "*" + dt, "slot_ptr": "*i64"},
                    dict(BLOCK_SIZE=bs, BLOCK_H=8, BLOCK_D=bd), arch)
    print("compiled")
    """
)


@pytest.mark.slow
def test_kernels_compile_for_gpu() -> None:
    """Every kernel compiled ahead of time for sm_80 and sm_90 within the shared-memory budget."""
    compile_kernels(_COMPILE_BODY)
