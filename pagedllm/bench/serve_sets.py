"""``bench serve --policies round_robin,cache_aware`` / ``--serve-args '...'`` (repeatable): the
pagedllm server started once per set of ``pagedllm serve`` flags, each driven with the same
requests and arrivals (``run_serve``), side by side with one engine (no data parallelism) as
the reference. With a KV tier (``--kv-transfer-config``) the prompt tokens loaded from it and
the bytes moved each way are read too: what the tier saved, and what it cost in traffic.

Per set, besides ``run_serve``'s TTFT, TPOT and throughput: the prompt positions the server
computed, ``pagedllm:computed_prefill_tokens`` read from ``/metrics`` before and after the run
and summed over the ``engine`` label (prompt tokens less prefix-cache hits, plus recomputation):
what a cache-aware router saves. Each set gets a fresh server, so no cache carries over.

    --policies P1,P2   sets "--data-parallel-size N --routing-policy P" (N: --data-parallel-size;
                       with --server-threads T each replica gets T // N threads, at least 1)
    --serve-args S     a set of its own, any flags (repeat the flag for more sets)
    reference          one engine with --pagedllm-args only (--no-reference drops it)
"""

from __future__ import annotations

import argparse
import math
import shlex
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from pagedllm.bench.serve_backends import (
    ServerSettings,
    free_port,
    running_server,
    server_command,
    summarize_runs,
)

REFERENCE = "1 engine"
# the tier's (--kv-transfer-config) are absent from a server without one: 0
COUNTERS = ("computed_prefill_tokens", "prompt_tokens", "prefix_cache_hits",
            "external_prefix_cache_hits", "kv_tier_bytes_loaded", "kv_tier_bytes_stored")


def add_set_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("pagedllm serve flag sets side by side (bench serve starts each)")
    g.add_argument("--policies", default=None, metavar="P1,P2",
                   help="routing policies to compare, each with --data-parallel-size replicas "
                   "(from: round_robin, least_load, cache_aware)")
    g.add_argument("--data-parallel-size", type=int, default=2,
                   help="replicas of each --policies set (default 2)")
    g.add_argument("--serve-args", action="append", default=[], metavar="FLAGS",
                   help="one set of extra `pagedllm serve` flags, one string; repeatable")
    g.add_argument("--no-reference", dest="reference", action="store_false",
                   help="skip the one-engine reference run")


def serve_sets(a: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(label, extra `pagedllm serve` flags) of every set, the reference first."""
    sets: list[tuple[str, list[str]]] = [(REFERENCE, [])] if a.reference else []
    n = a.data_parallel_size
    for pol in [x.strip() for x in (a.policies or "").split(",") if x.strip()]:
        if n < 1:
            raise ValueError(f"--data-parallel-size {n} must be >= 1")
        flags = ["--data-parallel-size", str(n), "--routing-policy", pol]
        if a.server_threads:
            flags += ["--data-parallel-threads", str(max(1, a.server_threads // n))]
        sets.append((f"dp{n} {pol}", flags))
    sets += [(s, shlex.split(s)) for s in a.serve_args]
    labels = [lab for lab, _ in sets]
    if len(sets) < 1 or len(set(labels)) != len(labels):
        raise ValueError(f"flag sets {labels}: give at least one, each once")
    return sets


def scrape(base_url: str) -> dict[str, dict[str, float]]:
    """``COUNTERS`` of the server's ``/metrics``, per ``engine`` label: {name: {engine: value}}."""
    import httpx

    return parse_counters(httpx.get(base_url.rstrip("/") + "/metrics", timeout=10).text)


def parse_counters(text: str) -> dict[str, dict[str, float]]:
    """``COUNTERS`` of a Prometheus text exposition, summed per ``engine`` label (the model
    label and any other summed over)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float]] = {c: {} for c in COUNTERS}
    wanted = {f"pagedllm:{c}_total": c for c in COUNTERS}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:  # by sample name: how the family is named varies by version
            c = wanted.get(s.name)
            if c is not None:
                e = s.labels.get("engine", "0")
                out[c][e] = out[c].get(e, 0.0) + s.value
    return out


def counted(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, Any]:
    """What the run added to each counter, summed over engines, and per engine."""
    res: dict[str, Any] = {}
    for c in COUNTERS:
        per = {e: after[c][e] - before[c].get(e, 0.0) for e in sorted(after[c])}
        res[c] = int(sum(per.values()))
        res[f"{c}_per_engine"] = {e: int(v) for e, v in per.items()}
    return res


def run_sets(sets: list[tuple[str, list[str]]], settings: ServerSettings, rounds: int,
             drive: Callable[[str], dict[str, Any]], start_timeout_s: float = 900.0) -> dict[str, Any]:
    """Each round starts, drives and stops every set in turn (odd rounds in reverse order).
    Returns the runs and a per-set summary (medians over rounds) with ratios to the first set."""
    runs: dict[str, list[dict[str, Any]]] = {lab: [] for lab, _ in sets}
    for r in range(rounds):
        for lab, flags in sets if r % 2 == 0 else sets[::-1]:
            port = free_port()
            cmd, env = server_command("pagedllm", replace(settings, extra=(*settings.extra, *flags)),
                                      port)
            print(f"round {r + 1}/{rounds}: {lab} ({shlex.join(flags) or 'no extra flags'})",
                  flush=True)
            with running_server(cmd, env, port, start_timeout_s) as base:
                before = scrape(base)
                res = drive(base)
                res.update(counted(before, scrape(base)))
            res.pop("per_request", None)
            runs[lab].append(res)
            print(f"  {lab}: {res['completed']} ok, {res['failed']} failed, computed prefill "
                  f"{res['computed_prefill_tokens']} of {res['prompt_tokens']} prompt tokens, "
                  f"{res['output_throughput']:.1f} out tok/s", flush=True)
    summary: dict[str, dict[str, Any]] = {}
    for lab, rs in runs.items():
        s = summarize_runs(rs)
        s["computed_prefill_tokens"] = _median([x["computed_prefill_tokens"] for x in rs])
        s["per_round_computed_prefill_tokens"] = [x["computed_prefill_tokens"] for x in rs]
        for k in ("prompt_tokens", "external_prefix_cache_hits", "kv_tier_bytes_loaded",
                  "kv_tier_bytes_stored"):
            s[k] = _median([x.get(k, 0) for x in rs])
        summary[lab] = s
    ref = sets[0][0]
    for s in summary.values():
        for k in ("computed_prefill_tokens", "output_throughput", "ttft_mean_ms", "tpot_mean_ms"):
            base = summary[ref][k]
            s[f"{k}_ratio"] = s[k] / base if base and not math.isnan(s[k]) else math.nan
    return {"benchmark": "serve-sets", "sets": {lab: flags for lab, flags in sets},
            "rounds": rounds, "reference": ref, "settings": dict(vars(settings)),
            "summary": summary, "runs": runs}


def _median(xs: list[float]) -> float:
    import statistics

    return statistics.median(xs) if xs else math.nan


def format_sets(res: dict[str, Any]) -> str:
    from pagedllm.bench.report import format_table

    ref = res["reference"]
    rows = [{"set": lab, "computed prefill": f"{s['computed_prefill_tokens']:.0f}",
             f"x {ref}": f"{s['computed_prefill_tokens_ratio']:.2f}",
             "prompt tok": f"{s['prompt_tokens']:.0f}",
             "tier loaded": f"{s.get('external_prefix_cache_hits', 0):.0f} tok "
                            f"{s.get('kv_tier_bytes_loaded', 0) / 2**20:.1f} MiB",
             "out tok/s": f"{s['output_throughput']:.1f}",
             "TTFT ms": f"{s['ttft_mean_ms']:.1f}", "TPOT ms": f"{s['tpot_mean_ms']:.1f}",
             "failed": s["failed"]}
            for lab, s in res["summary"].items()]
    return format_table(rows, tuple(rows[0]))
