"""Quantized KV through the whole engine (tiny random Llama): quantized blocks survive swap
preemption and compaction bit-exactly (greedy tokens and logprobs equal a roomy pool's with the
same KV dtype), start-up sizing, ``kv_stats()``, ``pagedllm plan``, and the Triton backend's tokens.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from engine_checks import assert_same_outputs, audit_kv_moves

from pagedllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
# Same KV dtype, tight pool (swap / compaction) vs roomy pool. Every moved block is checked
# bit-exact (audit_kv_moves); the logprobs still differ a little because a different batch shape
# moves the fp32 K/V projections by ~1e-7, and a value that sits on a rounding boundary then
# quantizes one step away. Measured max |Δ| over 10 prompts x 24 tokens: 4.4e-6 (int8), 1.0e-5
# (fp8 mixed), 5.2e-4 (V int8; 1.0e-4 with no memory feature at all, only max_num_seqs=1).
LP_TOL = 2e-3
KV_DTYPES = [dict(kv_cache_dtype="int8"), dict(v_cache_dtype="int8"),
             dict(kv_cache_dtype="fp8_e4m3", v_cache_dtype="fp8_e5m2")]


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 512) for _ in range(rng.randrange(5, 60))] for _ in range(n)]


def _generate(llm: LLM, prompts: list[list[int]], defrag: bool = False) -> tuple[list, int, int]:
    """(outputs in prompt order, steps, blocks moved by on-demand ``defragment`` calls)."""
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"q{i}", {"prompt_token_ids": p}, GREEDY)
    done: dict[str, object] = {}
    steps = moved = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
        steps += 1
        if defrag:
            moved += llm.defragment()
        eng.check_integrity()
    assert len(done) == len(prompts)
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    return [done[f"q{i}"] for i in range(len(prompts))], steps, moved


@pytest.mark.parametrize("kv", [KV_DTYPES[0], *(pytest.param(k, marks=pytest.mark.slow) for k in KV_DTYPES[1:])],
                         ids=["int8", "v-int8", "fp8-mixed"])
def test_swap_and_compaction_keep_quantized_greedy_outputs(
    tiny_models: dict[str, Path], kv: dict[str, str]
) -> None:
    model = str(tiny_models["llama"])
    base = dict(model=model, block_size=4, max_model_len=128, max_num_batched_tokens=48, **kv)
    prompts = _prompts(10)
    reference, _, _ = _generate(LLM(num_kv_blocks=256, enable_prefix_caching=False, **base), prompts)
    # 36 blocks of 4 tokens for 10 requests of up to 83 tokens: preemption by swap is certain
    tight = LLM(num_kv_blocks=36, swap_space=0.002, preemption_mode="swap", reserved_fraction=0.0,
                **base)
    moves = audit_kv_moves(tight)
    assert_same_outputs(_generate(tight, prompts)[0], reference, LP_TOL, "swap")
    assert moves["swapped_in"] > 0
    kinds = tight.engine.scheduler.preemptions_by_kind
    assert kinds["swap"] > 0 and kinds["recompute"] == 0
    stats = tight.kv_stats()
    assert stats["swapped_out_blocks"] == stats["swapped_in_blocks"] > 0
    assert tight.engine.kv.num_host_blocks == int(0.002 * 2**30) // (
        stats["kv_bytes_per_token"] * 4
    )
    # on demand after every step, and the every-2-steps trigger on top
    compacted = LLM(num_kv_blocks=80, compact_every_n_steps=2, **base)
    moves = audit_kv_moves(compacted)
    outs, steps, moved = _generate(compacted, prompts, defrag=True)
    assert_same_outputs(outs, reference, LP_TOL, "compaction")
    assert moved > 0 and moves["copied"] >= moved
    assert compacted.engine.memory.num_compactions == steps + steps // 2


def test_budget_holds_more_tokens_and_stats_say_so(tiny_models: dict[str, Path]) -> None:
    model = str(tiny_models["llama"])  # fp32, 2 layers, 2 KV heads, head_dim 32
    kw = dict(model=model, kv_cache_memory="1MiB", max_model_len=256)
    full, q8 = LLM(**kw), LLM(kv_cache_dtype="int8", **kw)
    s_full, s_q8 = full.kv_stats(), q8.kv_stats()
    assert s_full["kv_bytes_per_token"] == 2 * 2 * 2 * 32 * 4 == 1024
    assert s_q8["kv_bytes_per_token"] == 2 * 2 * 2 * (32 + 2) == 272
    assert (s_q8["k_cache_dtype"], s_q8["v_cache_dtype"]) == ("int8", "int8")
    assert s_full["num_blocks"] == 2**20 // (1024 * 16) == 64
    assert s_q8["num_blocks"] == 2**20 // (272 * 16) == 240
    assert q8.engine.runner.kv_cache.nbytes <= 2**20


def test_plan_shows_quantized_sizing(tiny_models: dict[str, Path]) -> None:
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "plan", "--model", str(tiny_models["llama"]),
           "--kv-cache-memory", "1MiB", "--max-model-len", "256", "--kv-cache-dtype", "auto",
           "--v-cache-dtype", "int8"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "KV per token     648 bytes (K float32 + V int8 (bf16 scales); 1024 at float32)" in r.stdout
    assert "pool             101 blocks = 1616 tokens" in r.stdout
    bad = subprocess.run(cmd[:-1] + ["int4"], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode != 0 and "int4" in bad.stderr


@pytest.mark.slow
def test_triton_engine_matches_cpu_on_quantized_cache(tiny_models: dict[str, Path]) -> None:
    """Interpreted Triton kernels (write + decode + chunked prefill) give the cpu backend's greedy
    tokens on an int8 K / fp8 V cache."""
    code = f"""
import os
os.environ["TRITON_INTERPRET"] = "1"
from pagedllm import LLM, SamplingParams
prompts = ["t5 t6 t7 t8 t9 t10 t11 t12 t13", "t9 t9", "t40 " * 30, "t7"]
sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
outs = {{}}
for backend in ("cpu", "triton"):
    llm = LLM(model={str(tiny_models["llama"])!r}, block_size=16, num_kv_blocks=64,
              max_model_len=256, max_num_batched_tokens=32, attention_backend=backend,
              k_cache_dtype="int8", v_cache_dtype="fp8_e4m3")
    outs[backend] = [r.outputs[0].token_ids for r in llm.generate(prompts, sp, use_tqdm=False)]
assert outs["triton"] == outs["cpu"], outs
print("ok")
"""
    pytest.importorskip("triton")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
