"""The replay drives the engine's own scheduler and KV manager: its decisions are the engine's."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedllm.args import EngineArgs
from pagedllm.bench.workload import BenchRequest
from pagedllm.config import default_model_path
from pagedllm.entrypoints.cli import main
from pagedllm.planner.cost import StepCostModel
from pagedllm.planner.replay import replay, summarize

ROOT = Path(__file__).resolve().parents[2]


def _config(**kw: object):  # type: ignore[no-untyped-def]
    return EngineArgs.from_kwargs({"max_model_len": 64, "block_size": 4, **kw}).create_engine_config()


@pytest.fixture
def one_thread() -> Iterator[None]:
    """torch on one thread for a real run (two threads on a busy 2-core machine crawl), restored
    after."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_all_at_once_scheduling_equals_the_real_engine_in_bench_throughput(
        tmp_path: Path, one_thread: None) -> None:
    """A trace whose requests all arrive at once, on the shipped model, in a pool small enough to
    preempt: steps, preemptions and peak running equal `bench throughput`'s real run."""
    rng = random.Random(7)
    trace = tmp_path / "trace.jsonl"
    lines = [json.dumps({"prompt_token_ids": [rng.randrange(4, 4000) for _ in range(rng.randint(8, 60))],
                         "max_tokens": rng.randint(4, 40)}) for _ in range(14)]
    lines += [json.dumps({"prompt": "def fibonacci(n):\n    return", "max_tokens": 30}),
              json.dumps({"prompt": "import os\nimport sys\n", "max_tokens": 12})]
    trace.write_text("\n".join(lines) + "\n")
    flags = ["--workload", "trace", "--trace", str(trace), "--block-size", "8",
             "--num-kv-blocks", "24", "--max-model-len", "128", "--max-num-seqs", "12",
             "--max-num-batched-tokens", "160"]
    bench_json, plan_json = tmp_path / "bench.json", tmp_path / "plan.json"
    assert main(["bench", "throughput", "--backends", "pagedllm", "--reps", "1", "--warmup", "0",
                 "--no-plot", "--threads", "1", "--output-dir", str(tmp_path), "--output-json", str(bench_json),
                 *flags]) == 0
    assert main(["plan", *flags, "--output-json", str(plan_json)]) == 0
    real = json.loads(bench_json.read_text())["results"][0]
    plan = json.loads(plan_json.read_text())
    keys = ("num_steps", "num_preemptions", "peak_running")
    assert {k: plan[k] for k in keys} == {k: real[k] for k in keys}
    assert real["num_preemptions"] > 0  # the pool is small enough to preempt
    assert plan["output_tokens"] == real["output_tokens"]


def test_stand_in_tokens_make_no_false_prefix_hits() -> None:
    """B's prompt is A's prompt followed by zeros: had A's outputs been zeros, B would hit A's
    output blocks. With out-of-vocabulary stand-ins it hits A's prompt blocks only."""
    a = [5, 6, 7, 8, 9, 10, 11, 12]
    reqs = [BenchRequest(a, 8, 0.0), BenchRequest(a + [0] * 8, 2, 100.0)]
    cost = StepCostModel((1, 2), (1.0, 1.0))  # one second per step
    res = replay(reqs, _config(), cost)
    assert res.first_token[0] < res.finished[0] < 100.0  # A finished (blocks cached) before B
    assert res.prefix_cache_hit_rate == 8 / (8 + 16)  # B's 16 prompt tokens hit A's 8


def test_timings_come_from_the_step_cost_model() -> None:
    """A 6-token prompt arriving at t=2.5 with a 4-token budget: two prefill steps (the second
    samples its first token), then decode steps. 1 s per step + 0.5 s per token."""
    cost = StepCostModel((1, 2), (1.5, 2.0))  # dense(T) = 1 + 0.5 T
    res = replay([BenchRequest(list(range(10, 16)), 3, 2.5)],
                 _config(max_num_batched_tokens=4), cost)
    steps = [3.0, 2.0, 1.5, 1.5]  # 4 tokens, 2 tokens, then two decodes
    assert res.num_steps == 4 and res.num_preemptions == 0 and res.peak_running == 1
    assert res.first_token == [2.5 + 3.0 + 2.0]
    assert res.finished == [2.5 + sum(steps)]
    assert res.ttft == [5.0] and res.tpot == [1.5]
    s = summarize(res)
    assert s["elapsed_s"] == 2.5 + sum(steps) and s["output_tokens_per_s"] == 3 / s["elapsed_s"]
    assert s["ttft_p99_s"] == 5.0 and s["tpot_p50_s"] == 1.5


def test_idle_gaps_jump_to_the_next_arrival() -> None:
    cost = StepCostModel((1, 2), (1.0, 1.0))  # one second per step
    res = replay([BenchRequest([5, 6], 1, 0.0), BenchRequest([7, 8], 1, 50.0)], _config(), cost)
    assert res.first_token == [1.0, 51.0] and res.num_steps == 2


def test_without_a_cost_model_everything_arrives_at_once_and_the_clock_counts_steps() -> None:
    reqs = [BenchRequest([5, 6, 7], 2, 0.0), BenchRequest([7, 8, 9], 2, 50.0)]
    res = replay(reqs, _config())
    assert not res.timed and res.num_steps == 2 and res.peak_running == 2
    assert "ttft_p50_s" not in summarize(res)


def test_an_elastic_pool_grows_as_the_engine_would() -> None:
    """The scheduler's memory policy (growth, idle shrink) runs in the replay too."""
    reqs = [BenchRequest(list(range(5, 45)), 20) for _ in range(6)]
    res = replay(reqs, _config(num_kv_blocks=96, initial_num_kv_blocks=16, grow_chunk=8))
    assert res.scheduler is not None
    memory = res.scheduler.memory
    assert memory.num_grows > 0 and memory.num_shrinks == 1  # shrunk back once idle
    assert res.scheduler.kv.num_blocks == 16 and res.num_preemptions == 0


def test_refusals_name_the_flag() -> None:
    with pytest.raises(ValueError, match="raise --max-model-len"):  # as the engine refuses it
        replay([BenchRequest(list(range(5, 70)), 1)], _config())


def test_importing_the_planner_does_not_import_torch() -> None:
    code = ("import sys, pagedllm.planner, pagedllm.planner.cli, pagedllm.planner.plan, "
            "pagedllm.planner.sweep, pagedllm.planner.profile; "
            "assert 'torch' not in sys.modules, 'the planner imported torch'")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 0, res.stderr


def test_shipped_model_path_is_the_default() -> None:
    assert _config().model.model == default_model_path()


def test_windowed_requests_count_only_their_window(make_model: object) -> None:
    """A sliding-window model replays with the engine's ring: more requests run at once in the
    same pool than with every block kept, none holds more than its window's blocks, and the
    plan says so."""
    path = make_model("mistral", sliding_window=8)  # type: ignore[operator]
    reqs = [BenchRequest(list(range(10 + i, 16 + i)), 40) for i in range(6)]
    runs = {}
    for free in (True, False):
        cfg = _config(model=str(path), num_kv_blocks=24, free_window_blocks=free)
        records: list[int] = []
        res = replay(reqs, cfg, on_step=lambda rec, _, seen=records: seen.append(
            rec.max_blocks_per_request))
        runs[free] = (res, max(records))
    (ring, most_ring), (kept, most_kept) = runs[True], runs[False]
    assert most_ring <= -(-8 // 4) + 1 < most_kept
    assert ring.num_preemptions == 0 < kept.num_preemptions
    from pagedllm.planner.plan import pool_lines

    lines = pool_lines(_config(model=str(path), num_kv_blocks=24))
    assert any("fits 8 requests of max_model_len=64 (sliding window 8" in ln for ln in lines)
