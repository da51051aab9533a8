"""The calibration grid, the pinning check and its refusal, and the held-out error (no engine)."""

from __future__ import annotations

import pytest

from pagedllm.planner.calibrate import CalibrationError, fit_profile
from pagedllm.planner.cost import (
    Features,
    StepCostModel,
    default_knots,
    fit,
    holdout_errors,
    relative_errors,
    unpinned_terms,
)
from pagedllm.planner.grid import Grid, Settings, plan_grid

SMALL = Settings(budget=2048, max_len=512, max_seqs=64, caching=True, num_blocks=100,
                 block_size=16)  # the pool: 1,600 tokens below a 2,048-token budget
TRUE = StepCostModel(knots=(1, 4, 16, 64, 256, 1024, 1597),
                     dense_s=(2e-3, 2.5e-3, 3e-3, 6.5e-3, 2.1e-2, 8e-2, 1.2e-1),
                     per_seq_s=5e-5, per_decode_context_s=8e-7, per_decode_shared_context_s=4e-7,
                     per_prefill_pair_s=2e-7)


def _cell_features(s: Settings, kind: str, c: int, b: int, p: int, chunk: int) -> Features:
    """What a step of the cell puts in its record (calibrate's _Runner builds it on the engine)."""
    cached = c if kind == "cached" else 0
    pieces = s.pieces(p, chunk, cached)
    pairs = sum(n * (cached + (n + 1) / 2) for n in pieces)
    ctx = 0 if kind in ("prefill", "cached") else c + (16 if kind == "shared" else 0)
    shared = c // s.block_size * s.block_size if kind == "shared" else 0
    return (float(b + p), float(b + len(pieces)), float(b * ctx), float(b * shared), pairs)


def _grid_samples(s: Settings, grid: Grid, kinds: tuple[str, ...] = ()) -> list[tuple[Features, float]]:
    out = []
    for kind, c, sizes in grid.groups:
        if kinds and kind not in kinds:
            continue
        for b, cells in sizes:
            for p, chunk in cells:
                f = _cell_features(s, kind, c, b, p, chunk)
                out.append((f, TRUE.predict(f)))
    return out


def _blocks_of_cell(s: Settings, kind: str, c: int, b: int, p: int, chunk: int) -> int:
    """Blocks a cell holds in its step, counted independently of ``Settings.fits``."""
    cached = c if kind == "cached" else 0
    room = min(s.max_len - 1 - cached, chunk or s.max_len)
    prompts, left = [], p
    while left > 0:
        prompts.append(min(left, room))
        left -= prompts[-1]
    decode = b * -(-(c + 64) // s.block_size) if kind == "decode" else 0
    return decode + sum(-(-(cached + n) // s.block_size) for n in prompts)


def test_a_pool_below_the_budget_sizes_every_cell_to_the_pool() -> None:
    grid = plan_grid(SMALL)
    prefill = [p for p, _ in grid.groups[0][2][0][1]]
    assert grid.top == 1597  # three 511-token prompts and one of 64 fill the 100 blocks
    assert prefill == [4, 16, 32, 64, 128, 256, 512, 1024, 1597, 256, 512, 1024, 1597]
    for kind, c, sizes in grid.groups:
        for b, cells in sizes:
            for p, chunk in cells:
                assert p >= 0 and b + p > 0, (kind, c, b, p)  # on main: P = -448
                assert _blocks_of_cell(SMALL, kind, c, b, p, chunk) <= SMALL.num_blocks
    assert grid.batches == {64: 8, 256: 4, 448: 2}
    assert "the pool: --num-kv-blocks" in grid.describe()
    # the planned grid determines every term (as the calibration then checks on real steps)
    samples = _grid_samples(SMALL, grid)
    knots = default_knots(grid.top)
    assert knots == TRUE.knots and unpinned_terms(samples, knots) == []
    got = fit(samples, knots)
    for g, t in zip(got.coefficients, TRUE.coefficients):
        assert g == pytest.approx(t, rel=1e-4)


def test_a_large_pool_keeps_the_budget_as_the_largest_prefill() -> None:
    big = Settings(2048, 2048, 64, True, 2048, 16)
    grid = plan_grid(big)
    assert grid.top == 2048 and grid.bounds["dense_s"] == "--max-num-batched-tokens"
    assert [k for k, _, _ in grid.groups] == ["prefill", "cached", "decode", "decode", "decode",
                                              "shared"]
    assert grid.batches == {64: 64, 256: 64, 512: 32}  # 32,768 context tokens at most


def test_a_term_no_step_pins_is_refused_with_the_flag_to_change() -> None:
    grid = plan_grid(SMALL)
    prefills = _grid_samples(SMALL, grid, ("prefill",))  # no decode cell ran
    with pytest.raises(CalibrationError) as e:
        fit_profile(prefills, SMALL, grid)
    msg = str(e.value)
    assert "per_decode_context_s (no timed step has it" in msg and "dense_s at 1 tokens" in msg
    assert "Raise --num-kv-blocks (or --kv-cache-memory)" in msg
    # the fit: two steps for eleven terms
    with pytest.raises(CalibrationError, match="cannot pin the step-cost model"):
        fit_profile(prefills[:2], SMALL, grid)
    with pytest.raises(CalibrationError, match="Raise --max-seconds"):
        fit_profile(prefills, SMALL, grid, stopped="stopped in group 2 of 6")
    # a max_model_len that leaves one decode context and no room for a shared prefix
    short = Settings(2048, 96, 64, True, 1000, 16)
    g = plan_grid(short)
    with pytest.raises(CalibrationError, match=r"bounded by --max-model-len=96.*Raise --max-model-len:"):
        fit_profile(_grid_samples(short, g), short, g)


def test_terms_the_settings_hold_constant_are_fixed_not_refused() -> None:
    """One request per step: S is always 1 and the dense part carries it. No prefix caching:
    shared context costs what private context does."""
    one = Settings(2048, 512, 1, False, 2048, 16)
    grid = plan_grid(one)
    prof = fit_profile(_grid_samples(one, grid), one, grid)
    assert prof.model.per_seq_s == 0 and prof.fit["fixed_terms"] == [
        "per_decode_shared_context_s", "per_seq_s"]
    assert prof.model.per_decode_shared_context_s == prof.model.per_decode_context_s > 0


def test_the_held_out_error_sees_what_the_in_sample_error_hides() -> None:
    """The top knot pinned by one step only: the fit passes through it (0 % in-sample), the
    fit without it cannot predict it."""
    grid = plan_grid(SMALL)
    samples = [(f, t) for f, t in _grid_samples(SMALL, grid) if f[0] != 1597]
    samples.append(((1597.0, 4.0, 0.0, 0.0, 394528.0), 0.19))  # the only step at the top
    knots = default_knots(1597)
    assert max(relative_errors(fit(samples, knots), samples)) < 1e-6
    held = holdout_errors(samples, knots)
    assert max(held) > 0.5 and held.index(max(held)) == len(samples) - 1
    # every term pinned twice over: what the fit did not see is predicted as well
    full = _grid_samples(SMALL, grid)
    assert max(holdout_errors(full, knots)) < 1e-3
    prof = fit_profile(full, SMALL, grid)
    assert prof.fit["holdout_max_rel_err"] < 1e-3 and prof.made_on["largest_timed_step"] == 1597
