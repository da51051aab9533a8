"""Sweeps, SLOs and the request-rate search, on a tiny profile."""

from __future__ import annotations

import math

import pytest

from pagedllm.args import EngineArgs
from pagedllm.bench.workload import BenchRequest, WorkloadSpec, make_workload
from pagedllm.planner.cost import StepCostModel
from pagedllm.planner.plan import Planner
from pagedllm.planner.profile import Profile
from pagedllm.planner.sweep import SLO, combinations, find_max_rate, parse_sweep, recommend

# 2 ms a step plus 0.1 ms a token plus 0.2 us per context token of decode attention
TINY = Profile(StepCostModel((1, 1024), (2.1e-3, 2e-3 + 1024e-4), per_decode_context_s=2e-7),
               {"clock": "wall"})


def _reqs(n: int = 40) -> list[BenchRequest]:
    spec = WorkloadSpec(num_prompts=n, seed=1, max_model_len=128, prompt_median=24,
                        output_median=12)
    return make_workload(spec, list(range(4, 500)))


def test_parse_sweep_converts_like_the_flags() -> None:
    axes = parse_sweep(["block_size=8,16", "kv-cache-memory=256MiB,1GiB",
                        "enable_prefix_caching=false,true", "num_gpu_blocks_override=64"])
    assert axes == [("block_size", [8, 16]), ("kv_cache_memory", ["256MiB", "1GiB"]),
                    ("enable_prefix_caching", [False, True]), ("num_kv_blocks", [64])]
    assert combinations(axes[:2]) == [
        {"block_size": 8, "kv_cache_memory": "256MiB"}, {"block_size": 8, "kv_cache_memory": "1GiB"},
        {"block_size": 16, "kv_cache_memory": "256MiB"}, {"block_size": 16, "kv_cache_memory": "1GiB"}]
    with pytest.raises(ValueError, match="did you mean 'block_size'"):
        parse_sweep(["blok_size=8"])
    with pytest.raises(ValueError, match="not a valid int"):
        parse_sweep(["block_size=eight"])
    with pytest.raises(ValueError, match="SETTING=V1,V2"):
        parse_sweep(["block_size"])
    with pytest.raises(ValueError, match="twice"):
        parse_sweep(["block_size=8", "block-size=16"])


def test_slo() -> None:
    s = {"ttft_p99_s": 0.4, "tpot_p99_s": 0.06}
    assert SLO(0.5, 0.1).met(s) and not SLO(0.3).met(s) and not SLO(None, 0.05).met(s)
    assert not SLO().active and SLO(tpot_p99_s=1).active
    with pytest.raises(ValueError, match="--slo-ttft-p99"):
        SLO(0.0)
    with pytest.raises(ValueError, match="--profile"):
        SLO(1.0).met({"num_steps": 3})


def test_find_max_rate_bisects_a_monotone_latency() -> None:
    """An M/M/1-like queue: TTFT p99 = 1 / (capacity - rate); SLO 0.5 s -> rate capacity - 2."""
    calls: list[float] = []

    def run(rate: float) -> dict[str, float]:
        calls.append(rate)
        return {"ttft_p99_s": math.inf if rate >= 10 else 1 / (10 - rate), "tpot_p99_s": 0.0}

    rate, at = find_max_rate(run, SLO(0.5), capacity_rps=10.0, rel_tol=1e-3)
    assert rate == pytest.approx(8.0, rel=2e-3) and rate <= 8.0 and at is not None
    assert len(calls) < 30
    assert find_max_rate(run, SLO(1e-6), 10.0) == (None, None)
    # a rate above capacity is never returned, even when a short trace would "meet" the SLO
    assert find_max_rate(lambda r: {"ttft_p99_s": 0.0, "tpot_p99_s": 0.0}, SLO(1.0), 10.0)[0] == 10.0


def test_sweep_rows_slo_and_recommendation_on_a_tiny_profile() -> None:
    planner = Planner(_reqs(), TINY)
    base = EngineArgs(max_model_len=128, block_size=8)
    slo = SLO(ttft_p99_s=0.5)
    axes = parse_sweep(["num_kv_blocks=16,256", "max_num_seqs=4,32"])
    rows = [planner.row(base, o, slo, None, False)[0] for o in combinations(axes)]
    by = {(r["num_kv_blocks"], r["max_num_seqs"]): r for r in rows}
    # a bigger pool and more seats never lose throughput here; the small pool preempts
    assert by[(256, 32)]["output_tokens_per_s"] > by[(16, 4)]["output_tokens_per_s"]
    assert by[(16, 32)]["num_preemptions"] > 0 and by[(256, 32)]["num_preemptions"] == 0
    assert by[(256, 32)]["peak_running"] > by[(256, 4)]["peak_running"] == 4
    best, why = recommend(rows, slo)
    met = [r for r in rows if r["meets_slo"]]
    if met:
        assert rows[best]["output_tokens_per_s"] == max(r["output_tokens_per_s"] for r in met)
    else:
        assert best is None and "no combination" in why
    # a combination the engine refuses is a row with an error, never recommended
    bad, _ = planner.row(base, {"num_kv_blocks": 4}, slo, None, False)
    assert "lower --max-model-len" in bad["error"]
    assert recommend([bad], slo) == (None, "every combination was refused")


def test_find_max_rate_through_the_replay() -> None:
    planner = Planner(_reqs(60), TINY)
    base = EngineArgs(max_model_len=128, block_size=8, max_num_seqs=16)
    row, _ = planner.row(base, {}, SLO(ttft_p99_s=0.05), None, True)
    rate = row["max_rate_rps"]
    at_once = planner.run(base, math.inf)[1]
    assert rate is not None and 0 < rate <= at_once["requests_per_s"]
    assert planner.run(base, rate)[1]["ttft_p99_s"] <= 0.05
    assert planner.run(base, rate * 1.1)[1]["ttft_p99_s"] > 0.05 or rate == at_once["requests_per_s"]
    assert recommend([row], SLO(ttft_p99_s=0.05))[0] == 0
