"""``pagedllm plan --data-parallel-size N``: N engine replicas predicted by N replays.

What is assumed (and so what the figure carries):

- **The split is round-robin**: request i goes to replica i mod N, with its own arrival time
  (the workload's, or its place in the whole workload's Poisson process). That is
  ``--routing-policy round_robin``; ``cache_aware`` sends a tenant's requests together, which
  changes each replica's prefix hits, not modelled here. Each replica's share is replayed
  through the engine's own scheduler and KV manager with the same settings (each replica has
  its own pool of the same size).
- **Threads**: the server gives each replica ``cores // N`` threads (``cores``: the profile's
  machine). When the profile's threads ``T`` fit in that share, every replica runs at the
  profile's step costs on cores of its own (memory bandwidth shared between them is not
  modelled). When ``T`` exceeds it, each step is taken to cost ``T / (cores // N)`` times the
  profile's, as if a step's time were inverse to its threads: a pessimistic bound for a small
  model, which gains less than that from threads; calibrate with ``--threads cores/N`` for an
  exact profile.
- The aggregate throughput is all replicas' output tokens over the slowest replica's elapsed
  time; latencies are percentiles over every request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedllm.planner.replay import replay

if TYPE_CHECKING:
    from pagedllm.bench.workload import BenchRequest
    from pagedllm.config import EngineConfig
    from pagedllm.planner.cost import Features, StepCostModel
    from pagedllm.planner.profile import Profile


@dataclass(frozen=True)
class SlowedCost:
    """A step-cost model whose every step costs ``factor`` times ``inner``'s."""

    inner: StepCostModel
    factor: float

    def predict(self, f: Features) -> float:
        return self.inner.predict(f) * self.factor


def thread_share(profile: Profile | None, n: int, cores: int | None = None) -> dict[str, Any]:
    """Threads per replica, the profile's threads, and the step-cost factor (module docstring)."""
    cores = cores or int((profile.made_on.get("cpu_count") if profile else None) or 1)
    per = max(1, cores // n)
    t = int(profile.made_on.get("torch_threads") or per) if profile else per
    return {"cores": cores, "threads_per_replica": per, "profile_threads": t,
            "step_cost_factor": max(1.0, t / per)}


def _replay_one(reqs: list[BenchRequest], arrivals: list[float], cfg: EngineConfig,
                cost: Any) -> dict[str, Any]:
    computed = [0]

    def count(rec: Any, _: float) -> None:
        computed[0] += rec.num_prefill_tokens

    res = replay(reqs, cfg, cost, arrivals, on_step=count)
    return {"elapsed_s": res.elapsed, "output_tokens": res.output_tokens, "ttft": res.ttft,
            "tpot": res.tpot, "computed_prefill_tokens": computed[0], "num_steps": res.num_steps,
            "num_requests": len(reqs)}


def _aggregate(parts: list[dict[str, Any]], timed: bool) -> dict[str, Any]:
    from pagedllm.bench.report import percentiles

    out: dict[str, Any] = {
        "num_requests": [p["num_requests"] for p in parts],
        "computed_prefill_tokens": sum(p["computed_prefill_tokens"] for p in parts),
        "num_steps": [p["num_steps"] for p in parts],
    }
    if timed:
        t = max(p["elapsed_s"] for p in parts)
        tokens = sum(p["output_tokens"] for p in parts)
        out.update({"elapsed_s": t, "output_tokens_per_s": tokens / t if t else 0.0,
                    "requests_per_s": sum(p["num_requests"] for p in parts) / t if t else 0.0,
                    "ttft": percentiles([x for p in parts for x in p["ttft"]]),
                    "tpot": percentiles([x for p in parts for x in p["tpot"]])})
    return out


def plan_replicas(reqs: list[BenchRequest], cfg: EngineConfig, profile: Profile | None, n: int,
                  arrivals: list[float] | None = None, cores: int | None = None) -> dict[str, Any]:
    """One engine and ``n`` round-robin replicas on ``reqs``: each one's prediction, and the
    ratio of their throughputs (with a ``profile``; without one, scheduling only)."""
    if n < 1:
        raise ValueError(f"--data-parallel-size {n} must be >= 1")
    arrivals = arrivals if arrivals is not None else [r.arrival_time or 0.0 for r in reqs]
    share = thread_share(profile, n, cores)
    cost = profile.model if profile else None
    one = _aggregate([_replay_one(reqs, arrivals, cfg, cost)], cost is not None)
    slowed = SlowedCost(cost, share["step_cost_factor"]) if cost is not None else None
    parts = [_replay_one(reqs[i::n], arrivals[i::n], cfg, slowed) for i in range(n)
             if reqs[i::n]]
    many = _aggregate(parts, cost is not None)
    out = {"data_parallel_size": n, "split": "round_robin", **share, "one_engine": one,
           "replicas": many}
    if cost is not None:
        base = one["output_tokens_per_s"]
        out["throughput_ratio"] = many["output_tokens_per_s"] / base if base else math.nan
    return out


def format_replicas(p: dict[str, Any]) -> list[str]:
    n, one, many = p["data_parallel_size"], p["one_engine"], p["replicas"]
    lines = [f"data parallel    {n} replicas, round-robin split {many['num_requests']} requests, "
             f"threads each {p['threads_per_replica']} ({p['cores']} cores; profile at "
             f"threads {p['profile_threads']}: step cost x {p['step_cost_factor']:.2f})",
             f"computed prefill one engine {one['computed_prefill_tokens']} tokens, {n} replicas "
             f"{many['computed_prefill_tokens']}"]
    if "output_tokens_per_s" in many:
        lines.append(
            f"predicted        one engine {one['output_tokens_per_s']:.1f} out tok/s, {n} replicas "
            f"{many['output_tokens_per_s']:.1f} out tok/s ({p['throughput_ratio']:.2f}x); TTFT "
            f"p50 {one['ttft'].get('p50', math.nan):.3f} s vs "
            f"{many['ttft'].get('p50', math.nan):.3f} s")
    return lines
