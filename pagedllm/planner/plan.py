"""One planner answer: a workload replayed under one set of engine settings, at one arrival
pattern, summarised (and the KV pool-sizing lines ``pagedllm plan`` printed before it replayed)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from pagedllm.args import EngineArgs
from pagedllm.kv.plan import plan_kv_pool
from pagedllm.planner.replay import ReplayResult, replay, summarize
from pagedllm.planner.sweep import SLO, find_max_rate

if TYPE_CHECKING:
    from pagedllm.bench.workload import BenchRequest
    from pagedllm.config import EngineConfig
    from pagedllm.planner.profile import Profile


@dataclass
class Planner:
    """Replays ``reqs`` with ``profile``'s step costs (None: scheduling only, no timings).
    Arrivals: the requests' own ``arrival_time`` (None = at once), or Poisson at ``rate``."""

    reqs: list[BenchRequest]
    profile: Profile | None = None
    seed: int = 0

    def run(self, args: EngineArgs, rate: float | None = None) -> tuple[ReplayResult, dict[str, Any]]:
        from pagedllm.bench.workload import arrivals

        cfg = args.create_engine_config()
        res = replay(self.reqs, cfg, self.profile.model if self.profile else None,
                     arrivals(self.reqs, rate, self.seed))
        s = summarize(res)
        s["kv_bytes"] = res.num_blocks * cfg.cache.kv_bytes_per_block(cfg.model)
        s["request_rate"] = "trace" if rate is None else rate
        return res, s

    def row(self, args: EngineArgs, overrides: dict[str, Any], slo: SLO, rate: float | None,
            search_rate: bool) -> tuple[dict[str, Any], ReplayResult | None]:
        """The summary of one combination (``overrides`` on ``args``) with ``meets_slo`` and,
        if ``search_rate``, ``max_rate_rps``; and its replay. A combination the engine would
        refuse is a row with ``error`` (and no replay)."""
        a = replace(args, **overrides)
        try:
            res, s = self.run(a, rate)
            if slo.active:
                s["meets_slo"] = slo.met(s)
            if search_rate:
                capacity = self.run(a, math.inf)[1]["requests_per_s"]
                best, at = find_max_rate(lambda r: self.run(a, r)[1], slo, capacity)
                s["max_rate_rps"] = best
                s["max_rate_is_capacity"] = best == capacity  # the search's ceiling
                if at is not None:
                    s["at_max_rate"] = {k: at[k] for k in ("ttft_p99_s", "tpot_p99_s",
                                                            "output_tokens_per_s")}
        except (ValueError, RuntimeError) as e:
            return {**overrides, "error": str(e)}, None
        return {**overrides, **s}, res


def pool_lines(cfg: EngineConfig) -> list[str]:
    """The KV pool sizing of ``cfg``: what fits, at what bytes per token (no weights loaded)."""
    plan = plan_kv_pool(cfg.model, cfg.cache, cfg.scheduler, lora=cfg.lora)
    m, c = cfg.model, cfg.cache
    lines = [
        f"model            {m.model} ({m.architecture}, {m.num_hidden_layers} layers, "
        f"{m.num_attention_heads} q heads / {m.num_key_value_heads} kv heads, head_dim "
        f"{m.head_dim}, {m.dtype}"
        + (f" compute, {m.weight_dtype} weights)" if m.weight_dtype else ")"),
        f"KV per token     {c.kv_bytes_per_token(m)} bytes ({c.kv_dtype_label(m)}; "
        f"{m.kv_bytes_per_token} at {m.dtype})",
        f"block            {plan.block_size} tokens = {plan.bytes_per_block} bytes",
        f"pool             {plan.num_blocks} blocks = {plan.num_tokens} tokens = "
        f"{plan.nbytes / 2**20:.1f} MiB",
        f"max_model_len    {plan.max_model_len} -> {plan.fit_summary()}",
    ]
    if m.sliding_window is not None and plan.sliding_window is None:
        why = ("--no-free-window-blocks" if not c.free_window_blocks else
               f"layers {list(m.full_attention_layers)} attend in full and one block id indexes "
               "every layer")
        lines.append(f"sliding window   {m.sliding_window}, but every block is kept: {why}")
    if cfg.is_cuda and c.kv_cache_memory is None and c.num_kv_blocks is None:
        lines.append(
            f"note             on {cfg.device} the engine sizes the pool at start-up from "
            f"--gpu-memory-utilization={cfg.gpu_memory_utilization} and a memory profile; "
            f"the figures above use the CPU default budget; pass --kv-cache-memory to plan "
            f"a GPU pool")
    return lines
