"""``pagedllm plan --data-parallel-size N [--routing-policy P]``: N engine replicas predicted by
N replays behind the router's own policy.

What is assumed (and so what the figure carries):

- **Routing is the server's** (``router.policy``, the same classes ``pagedllm serve -dp N``
  routes with): each request, at its arrival time, goes where the policy sends it, seeing each
  replica's load (requests routed and not finished, KV use) and, for ``cache_aware``, the exact
  blocks its replayed KV manager has published by then (its KV events, as the server's router
  hears them) plus those of requests routed there and not finished. Each replica is replayed
  through the engine's own scheduler and KV manager with the same settings (a pool of the same
  size each), advanced step by step to each arrival. Without a profile every request arrives at
  once (the clock counts steps), so routing sees only what is pending.
- **Threads**: the server gives each replica ``(cores - 1) // N`` threads, at least 1
  (``cores``: the profile's machine). When the profile's threads ``T`` fit in that share, every replica runs at the
  profile's step costs on cores of its own (memory bandwidth shared between them is not
  modelled). When ``T`` exceeds it, each step is taken to cost ``T / ((cores - 1) // N)`` times the
  profile's, as if a step's time were inverse to its threads: a pessimistic bound for a small
  model, which gains less than that from threads; calibrate with ``--threads (cores-1)/N`` for an
  exact profile.
- The router's messages take no time: a replica's events are heard at the end of its step.
- The aggregate throughput is all replicas' output tokens over the slowest replica's elapsed
  time; latencies are percentiles over every request.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from pagedllm.planner.replay import ReplayResult, quiet_engine
from pagedllm.planner.sim_engine import SimulatedEngine
from pagedllm.router.policy import (
    IMBALANCE_THRESHOLD,
    ReplicaLoad,
    RoutingPolicy,
    make_policy,
)
from pagedllm.router.prefix_index import lookup_blocks, request_block_hashes

if TYPE_CHECKING:
    from pagedllm.bench.workload import BenchRequest
    from pagedllm.config import EngineConfig
    from pagedllm.planner.cost import Features, StepCostModel
    from pagedllm.planner.profile import Profile
    from pagedllm.sched.stats import StepStats


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
    per = max(1, (cores - 1) // n)  # the server leaves one core to its API process
    t = int(profile.made_on.get("torch_threads") or per) if profile else per
    return {"cores": cores, "threads_per_replica": per, "profile_threads": t,
            "step_cost_factor": max(1.0, t / per)}


def _part(res: ReplayResult, computed: int, routed: list[int]) -> dict[str, Any]:
    return {"elapsed_s": res.elapsed, "output_tokens": sum(res.num_output[i] for i in routed),
            "ttft": [res.ttft[i] for i in routed], "tpot": _tpot(res, routed),
            "computed_prefill_tokens": computed, "num_steps": res.num_steps,
            "num_requests": len(routed)}


def _tpot(res: ReplayResult, routed: list[int]) -> list[float]:
    return [t for i in routed if (t := res.request_tpot(i)) is not None]


@quiet_engine()
def _replay_routed(reqs: list[BenchRequest], arrivals: list[float], cfg: EngineConfig,
                   cost: Any, n: int, policy: RoutingPolicy) -> list[dict[str, Any]]:
    """``n`` replays behind ``policy``: each request routed at its arrival (module docstring)."""
    reps = [SimulatedEngine(reqs, cfg, cost, arrivals) for _ in range(n)]
    computed = [0] * n
    routed: list[list[int]] = [[] for _ in range(n)]
    running: list[dict[int, list[str]]] = [{} for _ in range(n)]  # routed, not finished: hashes
    for k, r in enumerate(reps):
        r.on_step = partial(_count, computed, k)
        if policy.uses_hashes:
            r.sched.kv.events.subscribe_batches(partial(policy.on_kv_events, k))

    def advance(k: int) -> None:  # N engines on their own clocks: a router's loop, not drive's
        reps[k].step()
        for i in reps[k].finished:
            policy.finished(k, running[k].pop(i))

    bs = cfg.cache.block_size
    for i in sorted(range(len(reqs)), key=lambda i: reps[0].arrivals[i]):
        t = reps[0].arrivals[i]
        for k, r in enumerate(reps):
            while r.busy and r.clock <= t:
                advance(k)
        ids = reqs[i].prompt_token_ids
        hashes = request_block_hashes(ids, bs) if policy.uses_hashes else []
        loads = [ReplicaLoad(k, len(running[k]), r.sched.kv.usage) for k, r in enumerate(reps)]
        k = policy.choose(hashes, lookup_blocks(len(ids), bs), loads).replica
        reps[k].admit(i)
        running[k][i] = hashes
        routed[k].append(i)
        policy.routed(k, hashes)
    for k, r in enumerate(reps):
        while r.busy:
            advance(k)
    return [_part(r.close(), computed[k], routed[k]) for k, r in enumerate(reps) if routed[k]]


def _count(computed: list[int], k: int, rec: StepStats, _: float) -> None:
    computed[k] += rec.num_prefill_tokens


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
                  arrivals: list[float] | None = None, cores: int | None = None,
                  policy: str = "round_robin",
                  imbalance_threshold: int = IMBALANCE_THRESHOLD) -> dict[str, Any]:
    """One engine and ``n`` replicas behind the router's ``policy`` on ``reqs``: each one's
    prediction, and the ratio of their throughputs (with a ``profile``; without one, scheduling
    only)."""
    if n < 1:
        raise ValueError(f"--data-parallel-size {n} must be >= 1")
    router = make_policy(policy, imbalance_threshold)
    arrivals = arrivals if arrivals is not None else [r.arrival_time or 0.0 for r in reqs]
    share = thread_share(profile, n, cores)
    cost = profile.model if profile else None
    one = _aggregate(_replay_routed(reqs, arrivals, cfg, cost, 1, make_policy("round_robin")),
                     cost is not None)
    slowed = SlowedCost(cost, share["step_cost_factor"]) if cost is not None else None
    many = _aggregate(_replay_routed(reqs, arrivals, cfg, slowed, n, router), cost is not None)
    out = {"data_parallel_size": n, "split": policy, **share, "one_engine": one,
           "replicas": many}
    if cost is not None:
        base = one["output_tokens_per_s"]
        out["throughput_ratio"] = many["output_tokens_per_s"] / base if base else math.nan
    return out


def format_replicas(p: dict[str, Any]) -> list[str]:
    n, one, many = p["data_parallel_size"], p["one_engine"], p["replicas"]
    lines = [f"data parallel    {n} replicas, {p['split']} split {many['num_requests']} requests, "
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
