"""``pagedllm plan`` (pool sizing, and with a workload the replay) and ``pagedllm plan calibrate``.

Registered by ``pagedllm.entrypoints.cli``; torch is imported only by ``calibrate`` and ``--compare``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pagedllm.args import EngineArgs
from pagedllm.router.policy import IMBALANCE_THRESHOLD, ROUTING_POLICIES

PLAN_COLUMNS = (
    ("num_kv_blocks", "KV blocks"), ("output_tokens_per_s", "out tok/s"),
    ("requests_per_s", "req/s"), ("ttft_p50_s", "TTFT p50 s"), ("ttft_p90_s", "p90"),
    ("ttft_p99_s", "p99"), ("tpot_p50_ms", "TPOT p50 ms"), ("tpot_p90_ms", "p90"),
    ("tpot_p99_ms", "p99"), ("peak_running", "peak run"), ("num_preemptions", "preempt"),
    ("num_steps", "steps"), ("kv_utilization", "KV util"), ("mean_pool_usage", "pool use"),
    ("prefix_cache_hit_rate", "hit rate"), ("lora_page_ins", "LoRA in"),
)
HOLDOUT_WARN = 0.15  # calibrate warns above this median error on held-out steps
TIMED = {"output_tokens_per_s", "requests_per_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s",
         "tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms"}


def register(subparsers: Any) -> None:
    from pagedllm.bench.workload import WorkloadSpec
    from pagedllm.planner.calibrate import CLOCKS

    p = subparsers.add_parser(
        "plan", allow_abbrev=False, help="size the KV pool; with --trace / --workload, replay it through the "
        "scheduler (no model) and predict throughput and latency from a --profile",
        description="Without a workload: the KV pool sizing of the settings (no weights "
        "loaded). With --trace FILE or --workload: the workload replayed through the engine's "
        "own scheduler and KV manager; with --profile (from `pagedllm plan calibrate`) also "
        "predicted tokens/s, TTFT and TPOT.")
    WorkloadSpec.add_cli_args(p, 64, arrivals=True)
    p.set_defaults(kind=None)
    g = p.add_argument_group("planner")
    g.add_argument("--profile", default=None, metavar="FILE",
                   help="step-cost profile from `pagedllm plan calibrate` (without it: "
                   "scheduling only, no timings)")
    g.add_argument("--sweep", nargs="+", default=None, metavar="SETTING=V1,V2",
                   help="replay every combination, e.g. block_size=8,16,32 "
                   "kv_cache_memory=256MiB,1GiB max_num_seqs=32,64")
    g.add_argument("--slo-ttft-p99", type=float, default=None, metavar="S",
                   help="target: p99 time to first token, seconds")
    g.add_argument("--slo-tpot", type=float, default=None, metavar="S",
                   help="target: p99 time per output token, seconds")
    g.add_argument("--find-max-rate", action="store_true",
                   help="bisect the largest Poisson request rate meeting the SLO")
    g.add_argument("--compare", action="store_true",
                   help="also run the real engine on the workload and print predicted vs "
                   "measured (a benchmark: loads the model)")
    g.add_argument("--compare-reps", type=int, default=1, help="real runs for --compare")
    g.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads for --compare (default: the profile's)")
    g.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                   help="also predict N replicas (each request routed by --routing-policy as "
                   "`serve -dp N` routes it, cores/N threads each) beside one engine; see "
                   "pagedllm.planner.dp")
    g.add_argument("--routing-policy", default="cache_aware", choices=ROUTING_POLICIES,
                   help="with --data-parallel-size: the router's policy (serve's default)")
    g.add_argument("--routing-imbalance-threshold", type=int, default=IMBALANCE_THRESHOLD,
                   help="with --data-parallel-size and cache_aware: as serve's flag")
    g.add_argument("--lora-adapters", type=int, default=0, metavar="N",
                   help="the workload's requests run N LoRA adapters in turn, each taking the "
                   "pages of one of --max-lora-rank on every projection (needs --enable-lora)")
    g.add_argument("--output-json", type=Path, default=None, metavar="FILE")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=cmd_plan)

    sub = p.add_subparsers(dest="plan_command", metavar="{calibrate}")
    c = sub.add_parser("calibrate", help="time real engine steps and fit a step-cost profile",
                       description="Times engine.step() over a grid of prefill tokens, decode "
                       "batch sizes and contexts on this machine, sized to what the KV pool and "
                       "the token budget allow, and fits the step-cost model "
                       "(pagedllm.planner.cost); refuses when the grid cannot pin every term, "
                       "naming the flag to change. Put engine flags after `calibrate`.")
    c.add_argument("--output", type=Path, required=True, metavar="FILE", help="profile JSON")
    c.add_argument("--reps", type=int, default=3, help="repetitions per grid cell (median kept)")
    c.add_argument("--max-seconds", type=float, default=300.0,
                   help="stop adding grid cells after this many seconds on --clock "
                   "(default: 300)")
    c.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    c.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                   help="wall: seconds as they pass (default); cpu: the process's CPU seconds, "
                   "what a step costs on a dedicated core (reproducible on a shared machine; "
                   "needs --threads 1)")
    EngineArgs.add_cli_args(c)
    c.set_defaults(func=cmd_calibrate)


def cmd_calibrate(a: argparse.Namespace) -> int:
    from pagedllm.planner.calibrate import calibrate, summarize_fit
    from pagedllm.planner.profile import fit_quality

    if a.reps < 1:
        raise ValueError(f"--reps={a.reps} must be >= 1")
    prof = calibrate(EngineArgs.from_cli(a), a.reps, a.max_seconds, a.threads, a.clock,
                     log=lambda s: print(s, file=sys.stderr))
    print(summarize_fit(prof.model))
    print(fit_quality(prof.fit))
    if prof.fit["holdout_median_rel_err"] > HOLDOUT_WARN:
        print(f"warning: the fit misses steps it did not see by "
              f"{prof.fit['holdout_median_rel_err']:.0%} (median), plans carry that; on a shared "
              f"machine use --clock cpu --threads 1, or raise --reps", file=sys.stderr)
    print(f"calibration took {prof.made_on['calibration_s']} s")
    print(f"wrote {prof.save(a.output)}")
    return 0


def cmd_plan(a: argparse.Namespace) -> int:
    from pagedllm.planner.plan import pool_lines

    args = EngineArgs.from_cli(a)
    cfg = args.create_engine_config()
    for line in pool_lines(cfg):
        print(line)
    if a.trace and a.kind is None:
        a.kind = "trace"
    if a.kind is None:
        for flag in ("profile", "sweep", "find_max_rate", "compare", "output_json"):
            if getattr(a, flag):
                raise ValueError(f"--{flag.replace('_', '-')} needs a workload: pass --trace "
                                 f"FILE or --workload longtail|chat|fixed")
        return 0
    return _replay(a, args)


def _replay(a: argparse.Namespace, args: EngineArgs) -> int:
    import dataclasses

    from pagedllm.bench.report import write_json
    from pagedllm.bench.workload import WorkloadSpec, build_workload, summarize
    from pagedllm.planner.plan import Planner
    from pagedllm.planner.profile import Profile, describe_setup
    from pagedllm.planner.sweep import SLO, combinations, parse_sweep, recommend

    slo = SLO(a.slo_ttft_p99, a.slo_tpot)
    if (slo.active or a.find_max_rate or a.compare) and not a.profile:
        raise ValueError("--slo-*, --find-max-rate and --compare need timings: pass --profile "
                         "FILE (from `pagedllm plan calibrate`)")
    if a.find_max_rate and not slo.active:
        raise ValueError("--find-max-rate needs a target: --slo-ttft-p99 and/or --slo-tpot")
    if a.data_parallel_size > 1 and (a.sweep or a.find_max_rate or a.compare):
        raise ValueError("--data-parallel-size goes with one setting: not with --sweep, "
                         "--find-max-rate or --compare")
    if a.request_rate is not None and not a.request_rate > 0:
        raise ValueError(f"--request-rate={a.request_rate} must be > 0")
    kw = dataclasses.asdict(args)
    spec, reqs, cfg = build_workload(kw, WorkloadSpec.cli_kwargs(a))
    if a.lora_adapters:  # request i runs adapter i mod N (ids 1..N)
        reqs = [dataclasses.replace(r, lora_id=1 + i % a.lora_adapters) for i, r in enumerate(reqs)]
    profile = Profile.load(a.profile) if a.profile else None
    print(f"workload         {spec.kind}: {len(reqs)} requests, "
          f"{sum(r.prompt_len for r in reqs)} prompt + {sum(r.max_tokens for r in reqs)} output "
          f"tokens; arrivals: {_arrivals(a, reqs)}")
    if profile is None:
        print("timings          need a step-cost profile: `pagedllm plan calibrate --output "
              "P.json [engine flags]`, then --profile P.json (without one every request arrives "
              "at once; scheduling below is exact)")
    else:
        print(f"profile          {profile.quality()}")
        for m in profile.mismatches(describe_setup(cfg)):
            print(f"warning          profile made on a different setup ({m}); timings carry "
                  f"that difference", file=sys.stderr)
    planner = Planner(reqs, profile, a.seed)
    axes = parse_sweep(a.sweep) if a.sweep else []
    runs = [planner.row(args, o, slo, a.request_rate, a.find_max_rate)
            for o in (combinations(axes) if axes else [{}])]
    rows = [r for r, _ in runs]
    keys = [k for k, _ in axes]
    _print_rows(rows, keys, timed=profile is not None, rates=a.find_max_rate, slo=slo.active)
    doc: dict[str, Any] = {
        "planner": "replay through pagedllm's Scheduler and KVCacheManager",
        "workload": {**spec.describe(), **summarize(reqs), "arrivals": _arrivals(a, reqs)},
        "profile": {"path": a.profile, **profile.made_on} if profile else None,
        "engine": {k: v for k, v in kw.items() if v is not None},
        "slo": dataclasses.asdict(slo) if slo.active else None,
        "results": rows,
    }
    if axes:
        best, why = recommend(rows, slo)
        doc["recommendation"] = None if best is None else {**rows[best], "why": why}
        if best is None:
            print(f"recommendation: none ({why})")
        else:
            pick = ", ".join(f"{k}={rows[best][k]}" for k in keys)
            print(f"recommendation: {pick} ({why})")
    else:
        doc.update(rows[0])
        res = runs[0][1]
        if res is not None:
            doc["kv_over_time"] = res.kv_series()
        if a.find_max_rate:
            mr = rows[0].get("max_rate_rps")
            print(f"max request rate meeting {slo.describe()}: "
                  + ("none" if mr is None else f"{mr:.3g} req/s"))
    if a.data_parallel_size > 1:
        doc["data_parallel"] = _replicas(a, reqs, cfg, profile)
    if a.compare:
        from pagedllm.planner.compare import compare, report_compare

        doc["compare"] = compare(reqs, kw, planner, a.request_rate, a.compare_reps,
                                 a.threads or (profile.made_on.get("torch_threads") if profile else None))
        report_compare(doc["compare"])
    if a.output_json:
        print(f"wrote {write_json(a.output_json, doc)}")
    return 0


def _replicas(a: argparse.Namespace, reqs: list[Any], cfg: Any, profile: Any) -> dict[str, Any]:
    """``--data-parallel-size N``: N replicas behind ``--routing-policy`` beside one engine,
    printed."""
    from pagedllm.bench.workload import poisson_arrivals
    from pagedllm.planner.dp import format_replicas, plan_replicas

    arrivals = (None if a.request_rate is None
                else poisson_arrivals(len(reqs), a.request_rate, a.seed))
    res = plan_replicas(reqs, cfg, profile, a.data_parallel_size, arrivals,
                        policy=a.routing_policy, imbalance_threshold=a.routing_imbalance_threshold)
    for line in format_replicas(res):
        print(line)
    return res


def _arrivals(a: argparse.Namespace, reqs: list[Any]) -> str:
    if a.request_rate is not None:
        return f"Poisson {a.request_rate:g} req/s (seed {a.seed})"
    if any(r.arrival_time for r in reqs):
        return "the trace's arrival_time"
    return "all at once"


def _print_rows(rows: list[dict[str, Any]], keys: list[str], timed: bool, rates: bool,
                slo: bool) -> None:
    """The table of rows (swept settings first), then each refused combination's error."""
    from pagedllm.bench.report import format_table

    lora = any(r.get("lora_page_ins") for r in rows)
    cols = [(k, k) for k in keys] + [c for c in PLAN_COLUMNS if (timed or c[0] not in TIMED)
                                     and (lora or c[0] != "lora_page_ins")]
    if rates:
        cols.append(("max_rate_rps", "max req/s"))
    if slo:
        cols.append(("meets_slo", "SLO"))
    print(format_table([_display(r) for r in rows], [c for c, _ in cols], [h for _, h in cols]))
    for r in rows:
        if "error" in r:
            print(f"refused {', '.join(f'{k}={r[k]}' for k in keys)}: {r['error']}")


def _display(r: dict[str, Any]) -> dict[str, Any]:
    d = dict(r)
    for k in list(r):
        if k.endswith("_s") and k.startswith("tpot_"):
            d[k[:-2] + "_ms"] = r[k] * 1e3
    if "meets_slo" in r:
        d["meets_slo"] = "yes" if r["meets_slo"] else "no"
    return d
