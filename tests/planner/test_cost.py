"""The step-cost model: features of a step, the fit, and the profile file."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.kv.manager import KVCacheManager
from pagedllm.planner.cost import (
    StepCostModel,
    default_knots,
    fit,
    relative_errors,
    step_features,
)
from pagedllm.planner.profile import Profile
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams
from pagedllm.sched import Scheduler
from pagedllm.sched.stats import StepStats

TRUE = StepCostModel(knots=(1, 4, 16, 64, 256, 1024), dense_s=(2e-3, 2.5e-3, 4e-3, 9e-3, 3e-2, 1.1e-1),
                     per_seq_s=5e-5, per_decode_context_s=4e-7, per_decode_shared_context_s=2e-7,
                     per_prefill_pair_s=1.5e-7)


def _synthetic_steps(n: int, seed: int = 0) -> list[tuple[tuple[float, ...], float]]:
    """Steps like the calibration grid's and a workload's: decode batches, prefills, mixes."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        b = rng.choice([0, 1, 2, 4, 8, 16, 32, 64])
        ctx = rng.choice([64, 256, 512])
        p = rng.choice([0, 0, 4, 16, 64, 256, 1000]) if b else rng.choice([4, 16, 64, 256, 1000])
        k = rng.choice([1, 4]) if p >= 64 else 1
        start = rng.choice([0, 0, 128])
        pairs = sum((p // k) * (start + (p // k + 1) / 2) for _ in range(k))
        shared = rng.choice([0, 0, 128])
        f = (float(b + p), float(b + (k if p else 0)), float(b * ctx), float(b * shared), pairs)
        out.append((f, TRUE.predict(f)))
    return out


def test_features_of_a_step_come_from_its_record() -> None:
    """Step 2 of two requests with a 6-token budget: A (prompt 4) decodes at context 5, B's
    prompt (9 tokens) continues after the 2 computed in step 1 with a 5-token chunk."""
    kv = KVCacheManager(32, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=6, max_model_len=64), kv)
    for rid, n in (("a", 4), ("b", 9)):
        sched.add_request(Request(rid, list(range(10, 10 + n)), SamplingParams(max_tokens=4)))
    out = sched.schedule()
    assert step_features(StepStats.open(sched, out)) == (6.0, 2.0, 0.0, 0.0, 4 * 2.5 + 2 * 1.5)
    sched.update(out, {"a": 1})
    out = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 5)]
    assert step_features(StepStats.open(sched, out)) == (6.0, 2.0, 5.0, 0.0, 5 * (2 + 3))


def test_shared_decode_context_counts_blocks_other_requests_hold() -> None:
    """B hits A's first two blocks (8 tokens); decoding, 8 of B's context are shared."""
    kv = KVCacheManager(32, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64), kv)
    prompt = list(range(10, 20))
    sched.add_request(Request("a", prompt, SamplingParams(max_tokens=8)))
    sched.update(sched.schedule(), {"a": 1})
    sched.add_request(Request("b", prompt[:8] + [30, 31], SamplingParams(max_tokens=8)))
    sched.update(sched.schedule(), {"a": 1, "b": 1})
    f = step_features(StepStats.open(sched, sched.schedule()))
    assert f[:4] == (2.0, 2.0, 12.0 + 11.0, 8.0 + 8.0)  # A's head is shared with B too


def test_interpolation_between_knots_and_beyond() -> None:
    m = StepCostModel((1, 4, 16), (1.0, 2.5, 4.0))
    assert [m.predict((t, 0, 0, 0, 0)) for t in (1, 2, 4, 10, 16, 28)] == [1.0, 1.5, 2.5, 3.25, 4.0, 5.5]
    assert StepCostModel((8,), (2.0,)).predict((4, 0, 0, 0, 0)) == 1.0  # one knot: through 0
    assert m.predict((1, 3, 100, 50, 10)) == 1.0  # the other terms are 0 here
    d = StepCostModel((1,), (0.0,), per_decode_context_s=2.0, per_decode_shared_context_s=0.5)
    assert d.predict((0, 0, 10, 4, 0)) == 6 * 2.0 + 4 * 0.5
    assert default_knots(2048) == (1, 4, 16, 64, 256, 1024, 2048)
    with pytest.raises(ValueError, match="increasing"):
        StepCostModel((4, 1), (1.0, 1.0))


def test_fit_recovers_known_coefficients() -> None:
    samples = _synthetic_steps(120)
    got = fit(samples, TRUE.knots)
    for g, t in zip(got.coefficients, TRUE.coefficients):
        assert g == pytest.approx(t, rel=1e-5)
    assert max(relative_errors(got, samples)) < 1e-6


def test_fit_under_noise_stays_close_and_non_negative() -> None:
    rng = random.Random(1)
    noisy = [(f, t * rng.uniform(0.95, 1.05)) for f, t in _synthetic_steps(300, seed=2)]
    got = fit(noisy, TRUE.knots)
    assert all(c >= 0 for c in got.coefficients)
    clean = _synthetic_steps(100, seed=3)  # predicts unseen steps within the noise
    assert max(relative_errors(got, clean)) < 0.06
    # a term the timings do not depend on comes out as (non-negative) ~0
    flat = [(f, 1e-3 + 1e-5 * f[0]) for f, _ in _synthetic_steps(100, seed=4)]
    m = fit(flat, TRUE.knots)
    assert min(m.coefficients) >= 0 and m.per_prefill_pair_s < 1e-12


def test_without_shared_samples_shared_context_costs_what_private_does() -> None:
    samples = [((f[0], f[1], f[2], 0.0, f[4]), t) for f, t in _synthetic_steps(120)]
    m = fit(samples, TRUE.knots)
    assert m.per_decode_shared_context_s == m.per_decode_context_s > 0


def test_knots_without_samples_get_zero() -> None:
    samples = [((t, 1.0, 0.0, 0.0, 0.0), 1e-3 * t) for t in (1.0, 2.0, 3.0, 4.0)]
    m = fit(samples, (1, 4, 16, 64))
    assert m.dense_s[2:] == (0.0, 0.0)


def test_profile_round_trip_and_mismatches(tmp_path: Path) -> None:
    made_on = {"model": "/m", "dtype": "float32", "torch_threads": 1, "clock": "cpu"}
    p = Profile(TRUE, made_on, {"median_rel_err": 0.05}, [[1.0, 1.0, 10.0, 0.0, 0.0, 0.002]])
    path = p.save(tmp_path / "prof.json")
    q = Profile.load(path)
    assert q.model == TRUE and q.made_on == made_on and q.samples == p.samples
    assert q.mismatches({"model": "/other", "dtype": "float32"}) == [
        "model: profile '/m', plan '/other'"]
    assert "no held-out error" in q.quality()  # a profile from before calibrate measured one
    path.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match="pagedllm plan calibrate"):
        Profile.load(path)
    with pytest.raises(ValueError, match="no such file"):
        Profile.load(tmp_path / "missing.json")
