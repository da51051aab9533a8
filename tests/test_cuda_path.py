"""The CUDA engine path, the parts that run without a GPU: host batches, the one-copy uploader,
KV sizing from a memory profile, the profiling step, and the decode-graph buckets and padding
(``DecodeGraphs(capture=False)`` runs the very static-buffer forward a graph records).
Tests that need a GPU are in tests/gpu/ (marked ``cuda``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from engine_checks import assert_same_outputs

from pagedllm import LLM, SamplingParams
from pagedllm.args import EngineArgs
from pagedllm.runner.batch import Uploader, build_host_batch, fetch
from pagedllm.runner.cuda_graph import capture_sizes
from pagedllm.runner.memory import GiB, MemoryProfile, MemoryProfiler, kv_budget


def test_host_batch_matches_the_drawing() -> None:
    """The example in runner/batch.py: r0 5 tokens from position 3, r1 1 token at 9, r2 2 at 0."""
    hb = build_host_batch([[1] * 5, [2], [3, 3]], [3, 9, 0], [[7, 4], [5, 6, 2], [8]],
                          block_size=4)
    assert hb.positions.tolist() == [3, 4, 5, 6, 7, 9, 0, 1]
    assert hb.q_start.tolist() == [0, 5, 6, 8]
    assert hb.seq_lens.tolist() == [8, 10, 2]
    # position p -> table[p // 4] * 4 + p % 4
    assert hb.slots.tolist() == [31, 16, 17, 18, 19, 9, 32, 33]
    assert hb.tables.tolist() == [[7, 4, 4], [5, 6, 2], [8, 8, 8]]  # padded with own blocks
    assert hb.max_query_len == 5 and not hb.is_decode_only
    assert build_host_batch([[1], [2]], [4, 0], [[3, 9], [1]], 4).is_decode_only


def test_host_batch_decode_path_equals_the_general_one() -> None:
    """A decode-only batch takes its own list path; adding one prefill row to it sends the same
    rows through the numpy path: the decode rows' arrays must be identical."""
    import random

    rng = random.Random(0)
    for _ in range(200):
        n, bs = rng.randint(1, 20), rng.choice([1, 4, 16])
        starts = [rng.randint(0, 90) for _ in range(n)]
        tables = [[rng.randrange(500) for _ in range(p // bs + 1 + rng.randint(0, 2))]
                  for p in starts]
        ids = [[rng.randrange(100)] for _ in range(n)]
        dec = build_host_batch(ids, starts, tables, bs)
        gen = build_host_batch(ids + [[1, 2]], starts + [0], tables + [[0] * (64 // bs + 1)], bs)
        assert dec.is_decode_only and dec.max_query_len == 1
        for f in ("input_ids", "positions", "slots", "seq_lens"):
            a, b = getattr(dec, f), getattr(gen, f)[:n]
            assert a.dtype == b.dtype and a.tolist() == b.tolist(), f
        assert dec.q_start.tolist() == gen.q_start[: n + 1].tolist()
        w = dec.tables.shape[1]
        assert dec.tables.dtype == gen.tables.dtype
        assert dec.tables.tolist() == [r[:w] for r in gen.tables[:n].tolist()]


def test_uploader_on_cpu_is_zero_copy_and_shaped() -> None:
    up = Uploader(torch.device("cpu"))
    a, b = np.arange(6).reshape(2, 3), np.array([5, 7])
    ta, tb = up.upload([a, b])
    assert ta.tolist() == [[0, 1, 2], [3, 4, 5]] and tb.tolist() == [5, 7]
    assert ta.dtype == torch.int64
    assert up.tensor([0.5, 1.0], torch.float32).tolist() == [0.5, 1.0]
    x, none = fetch([torch.tensor([1, 2]), None])
    assert none is None and x is not None and x.tolist() == [1, 2]


def _profile(**kw: int) -> MemoryProfile:
    base = dict(total=80 * GiB, free_at_start=79 * GiB, weights=16 * GiB,
                activation_peak=2 * GiB, non_torch=GiB // 2, graph_pool=GiB // 4)
    return MemoryProfile(**{**base, **kw})


def test_kv_budget_is_the_fraction_of_free_memory_minus_the_rest() -> None:
    p = _profile()
    assert p.non_kv == 16 * GiB + 2 * GiB + GiB // 2 + GiB // 4
    assert kv_budget(p, 0.9) == int(0.9 * 79 * GiB) - p.non_kv
    assert kv_budget(p, 0.5) == int(0.5 * 79 * GiB) - p.non_kv
    # a shared GPU: only what was free counts
    assert kv_budget(_profile(free_at_start=40 * GiB), 0.9) == int(0.9 * 40 * GiB) - p.non_kv


def test_kv_budget_says_what_to_change_when_nothing_is_left() -> None:
    with pytest.raises(ValueError, match=r"no GPU memory left.*weights take 16\.00 GiB"
                                         r".*raise --gpu-memory-utilization"):
        kv_budget(_profile(), 0.2)


def test_profiler_needs_cuda() -> None:
    with pytest.raises(ValueError, match="kv_cache_memory or num_kv_blocks"):
        MemoryProfiler(torch.device("cpu"))


def test_engine_config_validates_device_and_utilization() -> None:
    with pytest.raises(ValueError, match="'cpu', 'cuda' or 'cuda:N'"):
        EngineArgs(device="gpu").create_engine_config()
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=1.5 must be in \(0, 1\]"):
        EngineArgs(gpu_memory_utilization=1.5).create_engine_config()
    assert EngineArgs(device="cuda:1", enforce_eager=True).create_engine_config().is_cuda


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_device_without_a_gpu_is_a_clear_error(tiny_models: dict[str, Path]) -> None:
    for size in ({"num_kv_blocks": 64}, {}):  # sized up front / from a memory profile
        with pytest.raises(ValueError, match="sees no CUDA GPU.*--device cpu"):
            LLM(model=str(tiny_models["llama"]), device="cuda", **size)


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(4) == [1, 2, 4]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


def test_profile_run_leaves_the_engine_untouched(tiny_models: dict[str, Path]) -> None:
    llm = LLM(model=str(tiny_models["llama"]), num_kv_blocks=32, max_model_len=128)
    before = _generate(llm, ["t5 t6 t7 t8"])
    kv = llm.engine.runner.kv_cache.storage.clone()
    llm.engine.runner.profile_run(num_tokens=300, num_reqs=7)  # ragged: 43 x 6 + 42
    assert torch.equal(llm.engine.runner.kv_cache.storage, kv)
    assert_same_outputs(_generate(llm, ["t5 t6 t7 t8"]), before, 1e-12, "after profiling")  # same batch: identical
    llm.engine.kv.pool.check_integrity()


def _generate(llm: LLM, prompts: list[str], max_tokens: int = 24) -> list:
    """Greedy outputs with the chosen tokens' logprobs, in prompt order."""
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert len(outs) == len(prompts)
    return [r.outputs[0] for r in outs]


# Padded static-buffer decode vs eager: the padding changes the matmul shapes only. Measured max
# |Δ logprob| over 7 prompts x 24 tokens: 4.8e-6 (llama, mistral), 5.2e-6 (resized pool).
LP_TOL = 1e-5


PROMPTS = ["t5 t6 t7 t8 t9 t10 t11 t12 t13", "t9 t9", "t40 " * 30, "t7", "t3 t4 t5",
           "t100 t101", "t11 " * 17]


@pytest.mark.parametrize("model", ["llama", "mistral"])
def test_decode_graph_path_gives_the_eager_tokens(tiny_models: dict[str, Path], model: str) -> None:
    """Decode steps through the padded static buffers (buckets 1, 2, 4, 8: 7 requests pad to 8,
    then 3 to 4 as they finish) give exactly the eager engine's tokens."""
    kw = dict(model=str(tiny_models[model]), block_size=4, num_kv_blocks=128, max_model_len=128,
              max_num_seqs=8)
    want = _generate(LLM(**kw), PROMPTS)
    llm = LLM(**kw)
    graphs = llm.engine.runner.enable_decode_graphs(capture=False)
    assert graphs.sizes == [1, 2, 4, 8]
    got = _generate(llm, PROMPTS)
    assert_same_outputs(got, want, LP_TOL, "decode graphs")
    assert graphs.replays > 0
    llm.engine.kv.pool.check_integrity()
    assert llm.engine.kv.pool.num_free_blocks == 128


def test_decode_graphs_follow_a_resized_pool(tiny_models: dict[str, Path]) -> None:
    """An elastic pool reallocates the KV storage; the graphs are rebuilt over the new one."""
    kw = dict(model=str(tiny_models["llama"]), block_size=4, num_kv_blocks=256,
              initial_num_kv_blocks=8, grow_chunk=8, max_model_len=128, max_num_seqs=8)
    want = _generate(LLM(**kw), PROMPTS)
    llm = LLM(**kw)
    graphs = llm.engine.runner.enable_decode_graphs(capture=False)
    got = _generate(llm, PROMPTS)
    assert_same_outputs(got, want, LP_TOL, "resized pool")
    assert graphs.generation > 0 and graphs.replays > 0  # rebuilt after a growth, then used


def test_a_failed_graph_capture_falls_back_to_eager(tiny_models: dict[str, Path],
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from pagedllm.runner.cuda_graph import DecodeGraphs
    from pagedllm.runner.model_runner import ModelRunner

    def broken(self: DecodeGraphs, warmup: bool = True) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(ModelRunner, "use_cuda_graphs", property(lambda self: True))
    monkeypatch.setattr(DecodeGraphs, "capture_all", broken)
    kw = dict(model=str(tiny_models["llama"]), block_size=4, num_kv_blocks=128, max_model_len=128)
    monkeypatch.setattr(logging.getLogger("pagedllm"), "propagate", True)  # into caplog
    with caplog.at_level(logging.WARNING):
        llm = LLM(**kw)
    assert llm.engine.runner.graphs is None
    assert "CUDA graph capture failed" in caplog.text and "stream is capturing" in caplog.text
    monkeypatch.undo()
    assert_same_outputs(_generate(llm, PROMPTS), _generate(LLM(**kw), PROMPTS), LP_TOL, "fallback")
