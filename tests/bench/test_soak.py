"""``bench soak`` at a tiny size: it drives a real `pagedllm serve` subprocess with mixed, partly
bad and partly abandoned traffic and reports every figure it promises (the targets themselves are
judged on long runs, README)."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest

from pagedllm.bench.soak import make_request
from pagedllm.entrypoints.cli import main


def test_the_request_mix_has_its_fractions() -> None:
    rng = random.Random(0)
    kinds = Counter(make_request(rng, 0.10, 0.05)[0] for _ in range(20000))
    assert abs(kinds["disconnect"] / 20000 - 0.10) < 0.01 and abs(kinds["invalid"] / 20000 - 0.05) < 0.01


@pytest.mark.slow  # a server subprocess on the shipped model
def test_soak_runs_and_reports_its_keys(tmp_path: Path) -> None:
    code = main(["bench", "soak", "--num-requests", "60", "--concurrency", "4", "--num-kv-blocks", "256",
                 "--output-dir", str(tmp_path)])
    r = json.loads((tmp_path / "soak.json").read_text())
    assert r["requests"] == 60 and set(r["by_kind"]) <= {"valid", "disconnect", "invalid"}
    for key in ("statuses", "valid_5xx", "invalid_5xx", "failures", "leaked_blocks", "kv_usage_at_idle",
                "rss_mib", "rss_growth_pct", "p99_ms", "p99_drift_pct", "loadavg", "drained_exit_code", "targets"):
        assert key in r, key
    assert r["rss_mib"]["samples"] and r["loadavg"]["samples"] and r["completed"] > 0
    t = r["targets"]
    assert t["valid_5xx"] and t["leaked_blocks"] and t["drain"], r  # these hold at any size
    assert code == (0 if all(t.values()) else 1)
