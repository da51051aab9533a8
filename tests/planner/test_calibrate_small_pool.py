"""``pagedllm plan calibrate`` on a KV pool smaller than the token budget (issue 35): the grid fits
the pool, every cell runs as planned, the fit reports its error on steps it did not see, and
the plan made from the profile predicts the real engine's throughput on a workload of its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedllm.entrypoints.cli import main
from pagedllm.planner.cost import unpinned_terms
from pagedllm.planner.profile import Profile

# 100 blocks x 16 = a 1,600-token pool below the default 2,048-token budget (the command)
ENGINE = ["--num-kv-blocks", "100", "--block-size", "16", "--max-model-len", "512"]


@pytest.fixture(scope="module")
def model(tiny_models: dict[str, Path]) -> str:
    return str(tiny_models["llama"])


def _main_one_thread(argv: list[str]) -> int:
    import torch

    threads = torch.get_num_threads()
    try:
        return main(argv)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def profile(model: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prof") / "small.json"
    # CPU seconds of one thread: what a step costs, reproducible on a shared machine
    assert _main_one_thread(["plan", "calibrate", "--model", model, *ENGINE, "--threads", "1",
                             "--clock", "cpu", "--output", str(path)]) == 0
    return path


def test_the_grid_fits_the_pool_and_every_term_is_pinned(profile: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    p = Profile.load(profile)
    assert p.made_on["pool_tokens"] == 1600 and p.made_on["max_num_batched_tokens"] == 2048
    tokens = [s[0] for s in p.samples]
    assert min(tokens) >= 1 and max(tokens) <= 1600  # on main: a prefill cell of P = -448
    assert p.made_on["largest_timed_step"] == max(tokens) == p.model.knots[-1] > 1024
    f = p.fit
    assert f["num_dropped_cells"] == 0 and f["num_samples"] >= 2 * f["num_terms"] == 22
    assert 0 < f["holdout_median_rel_err"] <= f["holdout_p90_rel_err"] <= f["holdout_max_rel_err"]
    assert f["holdout_median_rel_err"] >= f["median_rel_err"] * 0.5
    # every term pinned: its column varies apart from the others' in the steps that ran, so the
    # fit determines it. Its sign is the machine's: the tiny model's decode attention at C <= 448
    # costs less than CI's noise and came out 0.0 (the fit is non-negative); its prefill
    # attention at 1,597 tokens is most of that step and always shows.
    knots = list(p.model.knots)
    samples = [(tuple(s[:-1]), s[-1]) for s in p.samples]
    assert unpinned_terms(samples, knots, f["fixed_terms"]) == []
    assert p.model.per_decode_context_s >= 0 and p.model.per_prefill_pair_s > 0


# The 15 % accuracy target is a benchmark's (docs/features/planner.md gives the command and the
# figures). A test may only catch a broken fit: the tiny model's real run is half a second, and
# on CI's fresh machines it measured anywhere from 30 % faster to 44 % slower than predicted.
# Issue 35's 2-cell fit was 5x off; a bound of 2x catches that and not a noisy machine.
@pytest.mark.slow  # a calibration and two real runs (~30 s)
def test_plan_predicts_the_real_run_within_2x(model: str, profile: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "cmp.json"
    assert _main_one_thread(["plan", "--model", model, *ENGINE, "--workload", "longtail",
                             "--num-prompts", "40", "--seed", "3", "--profile", str(profile),
                             "--compare", "--compare-reps", "2",
                             "--output-json", str(out_json)]) == 0
    doc = json.loads(out_json.read_text())
    rows = {r["metric"]: r for r in doc["compare"]["rows"]}
    tok = rows["output_tokens_per_s"]
    assert 0.5 < tok["predicted"] / tok["measured"] < 2.0, tok  # issue 35's fit: 5x off
    assert rows["num_preemptions"]["measured"] > 0  # the pool is what limits this workload
    assert rows["num_steps"]["predicted"] == rows["num_steps"]["measured"]
    out, err = capsys.readouterr()
    assert "did not see" in out and "warning" not in err  # same setup: nothing to warn about


def test_a_cell_that_does_not_fit_is_dropped_not_fitted(model: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A grid that over-plans (a 3,000-token prefill in a 1,600-token pool): the cell's step runs
    what fits, the calibration drops the cell, aborts its leftovers and goes on."""
    from pagedllm.args import EngineArgs
    from pagedllm.planner import calibrate as cal
    from pagedllm.planner.grid import Grid

    grid = Grid([("prefill", 0, [(0, [(4, 0), (3000, 0), (16, 0), (64, 0)])])], 64)
    monkeypatch.setattr(cal, "plan_grid", lambda s: grid)
    lines: list[str] = []
    args = EngineArgs(model=model, num_kv_blocks=100, block_size=16, max_model_len=512)
    with pytest.raises(cal.CalibrationError, match="per_decode_context_s"):
        cal.calibrate(args, reps=1, threads=1, clock="cpu", log=lines.append)
    dropped = [x for x in lines if "did not run as planned" in x]
    assert len(dropped) == 1 and "prefill C=0 B=0 P=3000: ran " in dropped[0]
    # the cells after it ran alone (a leftover prompt in their step would drop them too)
    assert [x.split()[-4] for x in lines if x.startswith("  prefill")] == ["3"]  # samples
