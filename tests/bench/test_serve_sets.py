"""``bench serve --workload multi-tenant --policies ...``: the workload's shape, the flag sets, the
/metrics counters, and a real run of one engine, 2 x round_robin and 2 x cache_aware."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.bench.serve_sets import add_set_args, counted, parse_counters, serve_sets
from pagedllm.bench.workload import WorkloadSpec, make_workload


def test_multi_tenant_workload_shares_each_system_prompt() -> None:
    spec = WorkloadSpec(kind="multi-tenant", num_tenants=3, users_per_tenant=4, system_len=20,
                        user_len=5, output_len=7)
    reqs = make_workload(spec, list(range(50, 1000)))
    assert len(reqs) == 12 and all(r.prompt_len == 25 and r.max_tokens == 7 for r in reqs)
    systems = [tuple(r.prompt_token_ids[:20]) for r in reqs]
    assert len(set(systems)) == 3 and all(systems.count(s) == 4 for s in set(systems))
    assert len({tuple(r.prompt_token_ids) for r in reqs}) == 12  # every question its own
    assert systems != sorted(systems, key=systems.index)  # shuffled: tenants interleave
    assert make_workload(spec, list(range(50, 1000))) == reqs  # seeded
    spread = make_workload(WorkloadSpec(kind="multi-tenant", num_prompts=10, num_tenants=4,
                                        system_len=20, user_len=5), list(range(50, 1000)))
    assert len(spread) == 10 and len({tuple(r.prompt_token_ids[:20]) for r in spread}) == 4
    with pytest.raises(ValueError, match="max_model_len"):
        make_workload(WorkloadSpec(kind="multi-tenant", system_len=500, max_model_len=512), [1])


def _ns(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_set_args(p)
    p.add_argument("--server-threads", type=int, default=None)
    return p.parse_args(list(argv))


def test_serve_sets_reference_first_and_threads_split() -> None:
    sets = serve_sets(_ns("--policies", "round_robin,cache_aware", "--server-threads", "4",
                          "--serve-args", "-dp 3 --routing-policy least_load"))
    assert [lab for lab, _ in sets] == ["1 engine", "dp2 round_robin", "dp2 cache_aware",
                                        "-dp 3 --routing-policy least_load"]
    assert sets[0][1] == [] and sets[3][1] == ["-dp", "3", "--routing-policy", "least_load"]
    assert sets[1][1] == ["--data-parallel-size", "2", "--routing-policy", "round_robin",
                          "--data-parallel-threads", "2"]
    assert [lab for lab, _ in serve_sets(_ns("--policies", "cache_aware", "--no-reference"))] \
        == ["dp2 cache_aware"]
    with pytest.raises(ValueError, match="each once"):
        serve_sets(_ns("--policies", "round_robin,round_robin"))


def test_counters_are_summed_over_engines() -> None:
    text = "\n".join([
        "# TYPE pagedllm:computed_prefill_tokens counter",
        'pagedllm:computed_prefill_tokens_total{engine="0",model_name="m"} 100.0',
        'pagedllm:computed_prefill_tokens_created{engine="0",model_name="m"} 1.7e9',
        'pagedllm:computed_prefill_tokens_total{engine="1",model_name="m"} 40.0',
        "# TYPE pagedllm:prompt_tokens counter",
        'pagedllm:prompt_tokens_total{engine="0",model_name="m"} 300.0',
        'pagedllm:prompt_tokens_total{engine="1",model_name="m"} 90.0', ""])
    after = parse_counters(text)
    assert after["computed_prefill_tokens"] == {"0": 100.0, "1": 40.0}
    before = {"computed_prefill_tokens": {"0": 10.0}, "prompt_tokens": {}, "prefix_cache_hits": {}}
    got = counted(before, after)
    assert got["computed_prefill_tokens"] == 130 and got["prompt_tokens"] == 390
    assert got["computed_prefill_tokens_per_engine"] == {"0": 90, "1": 40}


@pytest.mark.slow
def test_cache_aware_computes_no_more_than_round_robin(tmp_path: Path) -> None:
    """The real command on the shipped model, one request at a time, 1 thread per replica:
    3 tenants x 2 users; cache_aware computes each system prompt once, as one engine does,
    round_robin on every replica a tenant reaches."""
    out = tmp_path / "res.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pagedllm", "bench", "serve", "--workload", "multi-tenant",
         "--num-tenants", "3", "--users-per-tenant", "2", "--system-len", "64", "--user-len",
         "8", "--output-len", "4", "--policies", "round_robin,cache_aware", "--server-threads",
         "1", "--pagedllm-args", "--block-size 16", "--server-kv-cache-memory", "64MiB",
         "--max-concurrency", "1", "--output-json", str(out), "--no-plot"],
        capture_output=True, text=True, timeout=590)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    assert res["reference"] == "1 engine" and res["workload"]["kind"] == "multi-tenant"
    s = res["summary"]
    assert list(s) == ["1 engine", "dp2 round_robin", "dp2 cache_aware"]
    for lab, x in s.items():
        assert x["failed"] == 0 and x["prompt_tokens"] == 6 * 72, lab
        assert x["output_throughput"] > 0 and x["ttft_mean_ms"] > 0 and x["tpot_mean_ms"] > 0
        assert 0 < x["computed_prefill_tokens"] <= x["prompt_tokens"]
    engines = {lab: set(r[0]["computed_prefill_tokens_per_engine"])
               for lab, r in res["runs"].items()}
    assert engines == {"1 engine": {"0"}, "dp2 round_robin": {"0", "1"},
                       "dp2 cache_aware": {"0", "1"}}
    rr, ca = s["dp2 round_robin"], s["dp2 cache_aware"]
    assert ca["computed_prefill_tokens"] <= rr["computed_prefill_tokens"]
    assert ca["computed_prefill_tokens"] <= 1.1 * s["1 engine"]["computed_prefill_tokens"]
    assert "dp2 cache_aware" in proc.stdout and "computed prefill" in proc.stdout
