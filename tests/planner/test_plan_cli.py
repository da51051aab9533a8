"""``pagedllm plan`` and ``pagedllm plan calibrate`` end to end, at tiny size."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pagedllm.entrypoints.cli import main
from pagedllm.planner.profile import Profile

ENGINE = ["--max-model-len", "128", "--block-size", "8", "--max-num-seqs", "8",
          "--max-num-batched-tokens", "256"]
WORKLOAD = ["--workload", "longtail", "--num-prompts", "12", "--prompt-median", "20",
            "--output-median", "10"]


@pytest.fixture(scope="module")
def model(tiny_models: dict[str, Path]) -> str:
    return str(tiny_models["llama"])


@pytest.fixture(scope="module")
def profile(model: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    threads = torch.get_num_threads()
    path = tmp_path_factory.mktemp("prof") / "p.json"
    try:
        assert main(["plan", "calibrate", "--model", model, *ENGINE, "--threads", "1",
                     "--reps", "1", "--output", str(path)]) == 0
    finally:
        torch.set_num_threads(threads)
    return path


def test_calibrate_writes_a_profile(profile: Path, model: str) -> None:
    p = Profile.load(profile)
    assert p.made_on["model"] == model and p.made_on["clock"] == "wall"
    assert p.made_on["torch_threads"] == 1 and p.made_on["max_num_batched_tokens"] == 256
    for k in ("torch", "dtype", "processor", "created"):
        assert p.made_on[k]
    assert p.model.knots == (1, 4, 16, 64, 256)
    assert all(c >= 0 for c in p.model.coefficients) and p.model.predict((8, 8, 400, 0, 0)) > 0
    assert p.fit["num_samples"] == len(p.samples) >= 12


def test_plan_without_a_workload_is_the_pool_sizing(model: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", model, *ENGINE]) == 0
    out = capsys.readouterr().out
    assert "pool             " in out and re.search(r"fits \d+ requests of max_model_len=\d+", out)
    assert main(["plan", "--model", model, "--profile", "x.json"]) == 2
    assert "--profile needs a workload" in capsys.readouterr().err


def test_plan_without_a_profile_says_timings_need_one(model: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "plan.json"
    assert main(["plan", "--model", model, *ENGINE, *WORKLOAD, "--output-json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "need a step-cost profile" in out and "out tok/s" not in out
    doc = json.loads(out_json.read_text())
    assert doc["num_steps"] > 0 and "output_tokens_per_s" not in doc
    assert main(["plan", "--model", model, *WORKLOAD, "--slo-ttft-p99", "1"]) == 2
    assert "need timings: pass --profile" in capsys.readouterr().err


def test_plan_with_a_profile_json_keys(model: str, profile: Path, tmp_path: Path) -> None:
    out_json = tmp_path / "plan.json"
    assert main(["plan", "--model", model, *ENGINE, *WORKLOAD, "--profile", str(profile),
                 "--request-rate", "50", "--output-json", str(out_json)]) == 0
    doc = json.loads(out_json.read_text())
    for k in ("output_tokens_per_s", "requests_per_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s",
              "tpot_p50_s", "tpot_p90_s", "tpot_p99_s", "peak_running", "num_preemptions",
              "num_steps", "kv_utilization", "prefix_cache_hit_rate"):
        assert isinstance(doc[k], (int, float)), k
    assert doc["output_tokens_per_s"] > 0 and doc["ttft_p99_s"] >= doc["ttft_p50_s"] > 0
    series = doc["kv_over_time"]
    assert len(series["t"]) == len(series["pool_usage"]) > 0
    assert series["t"] == sorted(series["t"]) and all(0 <= u <= 1 for u in series["pool_usage"])
    assert doc["workload"]["arrivals"].startswith("Poisson 50")


def test_sweep_with_slo_and_max_rate(model: str, profile: Path, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "sweep.json"
    assert main(["plan", "--model", model, *ENGINE, *WORKLOAD, "--profile", str(profile),
                 "--sweep", "block_size=8,16", "max_num_seqs=2,8", "--slo-ttft-p99", "10",
                 "--find-max-rate", "--output-json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "recommendation: block_size=" in out and "max req/s" in out
    doc = json.loads(out_json.read_text())
    assert [(r["block_size"], r["max_num_seqs"]) for r in doc["results"]] == [
        (8, 2), (8, 8), (16, 2), (16, 8)]
    assert doc["recommendation"]["max_rate_rps"] == max(r["max_rate_rps"] for r in doc["results"])


def test_compare_runs_the_real_engine(model: str, profile: Path, tmp_path: Path) -> None:
    import torch

    threads = torch.get_num_threads()
    out_json = tmp_path / "cmp.json"
    try:
        assert main(["plan", "--model", model, *ENGINE, *WORKLOAD, "--profile", str(profile),
                     "--compare", "--output-json", str(out_json)]) == 0
    finally:
        torch.set_num_threads(threads)
    rows = {r["metric"]: r for r in json.loads(out_json.read_text())["compare"]["rows"]}
    for k in ("num_steps", "num_preemptions", "peak_running"):  # all at once: exact
        assert rows[k]["predicted"] == rows[k]["measured"], k
    assert rows["output_tokens_per_s"]["measured"] > 0 and rows["ttft_mean_s"]["error"] is not None


def test_plan_warns_when_the_profile_was_made_on_another_pool_budget_or_machine(
        model: str, profile: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", model, *ENGINE, *WORKLOAD, "--profile", str(profile)]) == 0
    out, err = capsys.readouterr()
    assert "warning" not in err and "on steps the fit did not see (leave-one-out)" in out
    doc = json.loads(profile.read_text())
    doc["made_on"]["hostname"] = "another-host"
    other = tmp_path / "other.json"
    other.write_text(json.dumps(doc))
    engine = [*ENGINE[:-1], "512", "--num-kv-blocks", "40"]  # budget 512, pool 320 tokens
    assert main(["plan", "--model", model, *engine, *WORKLOAD, "--profile", str(other)]) == 0
    err = capsys.readouterr().err
    assert "(machine: profile 'another-host'" in err
    assert "(token budget (--max-num-batched-tokens): profile 256, plan 512)" in err
    assert "(KV pool (tokens): profile " in err and "plan 320)" in err
    assert "largest step: profile timed steps of up to 256 tokens, the plan's pool and " \
        "budget allow 320" in err
