"""``pagedllm plan --data-parallel-size N``: N replicas replayed behind the router's own policy,
beside one engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedllm.args import EngineArgs
from pagedllm.bench.workload import BenchRequest
from pagedllm.entrypoints.cli import main
from pagedllm.planner.cost import StepCostModel
from pagedllm.planner.dp import plan_replicas, thread_share
from pagedllm.planner.profile import Profile

ONE_S_PER_STEP = StepCostModel((1, 2), (1.0, 1.0))
PER_TOKEN = StepCostModel((1, 1024), (0.01, 10.24))  # 10 ms a token


def _config(**kw: object):  # type: ignore[no-untyped-def]
    return EngineArgs.from_kwargs({"max_model_len": 64, "block_size": 4, "max_num_seqs": 1,
                                   **kw}).create_engine_config()


def _profile(threads: int, cores: int, cost: StepCostModel = ONE_S_PER_STEP) -> Profile:
    return Profile(cost, {"torch_threads": threads, "cpu_count": cores})


def test_two_replicas_each_run_half_the_steps() -> None:
    """8 requests of 4 prompt + 3 output tokens, one running at a time, 1 s a step: one engine
    takes 8 x 3 steps, each of 2 replicas 4 x 3 (its own cores: profile at 1 thread, 2 cores);
    with a 2-thread profile on 2 cores each replica's steps cost twice as much."""
    reqs = [BenchRequest([10 + i, 20 + i, 30 + i, 40 + i], 3) for i in range(8)]
    p = plan_replicas(reqs, _config(), _profile(1, 2), 2)
    assert p["one_engine"]["elapsed_s"] == 24.0 and p["replicas"]["elapsed_s"] == 12.0
    assert p["one_engine"]["output_tokens_per_s"] == 1.0
    assert p["replicas"]["output_tokens_per_s"] == 2.0 and p["throughput_ratio"] == 2.0
    assert p["replicas"]["num_requests"] == [4, 4] and p["threads_per_replica"] == 1
    shared = plan_replicas(reqs, _config(), _profile(2, 2), 2)
    assert shared["step_cost_factor"] == 2.0 and shared["throughput_ratio"] == 1.0
    assert thread_share(_profile(2, 16), 4) == {"cores": 16, "threads_per_replica": 3,
                                                 "profile_threads": 2, "step_cost_factor": 1.0}


def test_round_robin_replicas_compute_a_shared_prefix_on_each() -> None:
    """4 requests with one 8-token system prompt (2 blocks) and 4 tokens of their own: one
    engine computes the prefix once (8 + 4 x 4), round-robin replicas once each (2 x 8 + 4 x 4);
    without a profile there are no timings."""
    system = list(range(100, 108))
    reqs = [BenchRequest(system + [200 + 4 * i + j for j in range(4)], 2) for i in range(4)]
    p = plan_replicas(reqs, _config(), None, 2)
    assert p["one_engine"]["computed_prefill_tokens"] == 24
    assert p["replicas"]["computed_prefill_tokens"] == 32
    assert "output_tokens_per_s" not in p["replicas"] and "throughput_ratio" not in p
    with pytest.raises(ValueError, match=">= 1"):
        plan_replicas(reqs, _config(), None, 0)


def _tenants() -> list[BenchRequest]:
    """4 tenants x 3 users, in tenant order: an 8-token system prompt (2 blocks) each, then 4
    tokens of the user's own."""
    return [BenchRequest(list(range(100 + 10 * t, 108 + 10 * t))
                         + [500 + 16 * t + 4 * u + j for j in range(4)], 2)
            for t in range(4) for u in range(3)]


@pytest.mark.parametrize("spaced", [False, True])
def test_cache_aware_computes_each_system_prompt_once(spaced: bool) -> None:
    """Round robin splits each tenant over both replicas (each computes its system prompt:
    4 x 2 x 8 + 12 x 4 = 112 tokens); cache_aware keeps a tenant on one replica and computes
    what one engine computes (4 x 8 + 12 x 4 = 80). All at once (no profile) the router sees
    only the requests pending; spaced 10 s apart (each finished before the next) only the
    replayed KV managers' events: the same answer either way."""
    reqs = _tenants()
    kw = dict(profile=_profile(1, 2), arrivals=[10.0 * i for i in range(12)]) if spaced else {}
    kw = {"profile": None, **kw}
    got = {pol: plan_replicas(reqs, _config(), n=2, policy=pol, **kw)  # type: ignore[arg-type]
           for pol in ("round_robin", "least_load", "cache_aware")}
    assert {p: g["replicas"]["computed_prefill_tokens"] for p, g in got.items()} == {
        "round_robin": 112, "least_load": 112, "cache_aware": 80}
    assert got["cache_aware"]["one_engine"]["computed_prefill_tokens"] == 80
    assert got["cache_aware"]["split"] == "cache_aware"
    assert got["cache_aware"]["replicas"]["num_requests"] == [6, 6]
    one = plan_replicas(reqs, _config(), n=1, policy="cache_aware", **kw)  # type: ignore[arg-type]
    assert one["replicas"] == one["one_engine"]  # one replica is one engine, whatever routes
    with pytest.raises(ValueError, match="--routing-policy 'nope'"):
        plan_replicas(reqs, _config(), None, 2, policy="nope")


def test_plan_cli_prints_both_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A cost per token: two replicas on cores of their own share the tokens, so the
    aggregate is faster than one engine (which batches them all in the same steps)."""
    prof = _profile(1, 2, PER_TOKEN).save(tmp_path / "p.json")
    out_json = tmp_path / "plan.json"
    argv = ["plan", "--block-size", "16", "--max-model-len", "256", "--workload", "multi-tenant",
            "--num-tenants", "4", "--users-per-tenant", "3", "--system-len", "64", "--user-len",
            "8", "--output-len", "8", "--profile", str(prof), "--data-parallel-size", "2"]
    assert main([*argv, "--output-json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "data parallel    2 replicas, cache_aware split [6, 6] requests" in out
    assert "out tok/s, 2 replicas" in out
    dp = json.loads(out_json.read_text())["data_parallel"]
    assert dp["replicas"]["output_tokens_per_s"] > dp["one_engine"]["output_tokens_per_s"] > 0
    assert dp["split"] == "cache_aware" and dp["replicas"]["computed_prefill_tokens"] > 0
    assert main([*argv, "--sweep", "block_size=8,16"]) == 2
    assert "--data-parallel-size goes with one setting" in capsys.readouterr().err
