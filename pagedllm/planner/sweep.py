"""Sweeps over engine settings, latency targets (SLOs), and the largest request rate meeting them.

    --sweep block_size=8,16,32 kv_cache_memory=256MiB,1GiB max_num_seqs=32,64

is every combination (3 x 2 x 2 = 12 replays). A combination *meets* an SLO when its predicted
p99 TTFT and p99 TPOT are at most the targets. ``find_max_rate`` bisects the rate of Poisson
arrivals (the same seeded process at every rate, so only its time scale changes) for the largest
one still meeting the SLO, up to the workload's all-at-once throughput (more is not sustainable;
use a trace long enough to reach a steady state, a few hundred requests or more).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedllm.args import EngineArgs
from pagedllm.flags import parse_setting

Summary = dict[str, Any]


@dataclass(frozen=True)
class SLO:
    """Latency targets in seconds; None = no target on that metric."""

    ttft_p99_s: float | None = None
    tpot_p99_s: float | None = None

    def __post_init__(self) -> None:
        for name, v in (("--slo-ttft-p99", self.ttft_p99_s), ("--slo-tpot", self.tpot_p99_s)):
            if v is not None and not v > 0:
                raise ValueError(f"{name}={v} must be > 0 seconds")

    @property
    def active(self) -> bool:
        return self.ttft_p99_s is not None or self.tpot_p99_s is not None

    def met(self, s: Summary) -> bool:
        if "ttft_p99_s" not in s:
            raise ValueError("an SLO needs timings: pass --profile (from `pagedllm plan calibrate`)")
        return ((self.ttft_p99_s is None or s["ttft_p99_s"] <= self.ttft_p99_s)
                and (self.tpot_p99_s is None or s["tpot_p99_s"] <= self.tpot_p99_s))

    def describe(self) -> str:
        parts = []
        if self.ttft_p99_s is not None:
            parts.append(f"TTFT p99 <= {self.ttft_p99_s:g} s")
        if self.tpot_p99_s is not None:
            parts.append(f"TPOT p99 <= {self.tpot_p99_s:g} s")
        return " and ".join(parts)


def parse_sweep(items: Sequence[str]) -> list[tuple[str, list[Any]]]:
    """``["block_size=8,16", "kv_cache_memory=256MiB,1GiB"]`` -> settings and their values,
    each value converted as its flag would be (``EngineArgs`` field names or flag names)."""
    axes: list[tuple[str, list[Any]]] = []
    aliases = EngineArgs.aliases()
    for item in items:
        name, sep, values = item.partition("=")
        texts = [v for v in values.split(",") if v.strip()]
        if not sep or not texts:
            raise ValueError(f"--sweep {item!r}: write SETTING=V1,V2,... "
                             f"(e.g. block_size=8,16,32)")
        parsed = [parse_setting(EngineArgs, name, v, aliases) for v in texts]
        key = parsed[0][0]
        if any(k == key for k, _ in axes):
            raise ValueError(f"--sweep names {key} twice; give all its values in one item")
        axes.append((key, [v for _, v in parsed]))
    return axes


def combinations(axes: Sequence[tuple[str, Sequence[Any]]]) -> list[dict[str, Any]]:
    """Every combination of the axes' values, the first axis varying slowest."""
    keys = [k for k, _ in axes]
    return [dict(zip(keys, vals)) for vals in itertools.product(*(v for _, v in axes))]


def find_max_rate(run: Callable[[float], Summary], slo: SLO, capacity_rps: float,
                  rel_tol: float = 0.02, max_iter: int = 40) -> tuple[float | None, Summary | None]:
    """Largest Poisson rate (requests/s) whose replay ``run(rate)`` meets ``slo``, within
    ``rel_tol``, searched up to ``capacity_rps`` (the all-at-once requests/s): above it the
    engine falls behind, and only the finite length of the trace keeps its queues short, so no
    rate above capacity is sustainable whatever a short trace shows. Returns (None, None) when no
    rate above ``capacity_rps / 2**12`` meets the SLO."""
    hi, lo = capacity_rps, capacity_rps
    lo_sum = run(lo)
    if slo.met(lo_sum):
        return lo, lo_sum
    while True:  # halve down to a rate that meets it
        hi, lo = lo, lo / 2
        if lo < capacity_rps / 2**12:
            return None, None
        lo_sum = run(lo)
        if slo.met(lo_sum):
            break
    for _ in range(max_iter):
        if hi - lo <= rel_tol * lo:
            break
        mid = (lo + hi) / 2
        s = run(mid)
        if slo.met(s):
            lo, lo_sum = mid, s
        else:
            hi = mid
    return lo, lo_sum


def recommend(rows: Sequence[Summary], slo: SLO) -> tuple[int | None, str]:
    """Index of the row to recommend and why. With a searched rate (``max_rate_rps``): the
    largest rate meeting the SLO. Else, with an SLO: among rows meeting it at the given arrivals,
    the most output tokens/s. Without one: the most output tokens/s. Ties go to the smaller KV
    pool; rows with an ``error`` are never picked."""
    ok = [i for i, r in enumerate(rows) if "error" not in r]
    if not ok or "output_tokens_per_s" not in rows[ok[0]]:
        return None, ("recommendations need timings: pass --profile" if ok
                      else "every combination was refused")

    def speed(i: int) -> tuple[float, float]:
        return rows[i]["output_tokens_per_s"], -rows[i]["kv_bytes"]

    if "max_rate_rps" in rows[ok[0]]:
        cand = [i for i in ok if rows[i]["max_rate_rps"] is not None]
        if not cand:
            return None, f"no combination meets {slo.describe()} at any request rate"
        return (max(cand, key=lambda i: (rows[i]["max_rate_rps"], *speed(i))),
                f"largest request rate meeting {slo.describe()}")
    if slo.active:
        cand = [i for i in ok if rows[i]["meets_slo"]]
        if not cand:
            return None, f"no combination meets {slo.describe()}"
        return max(cand, key=speed), f"meets {slo.describe()}; most output tokens/s"
    return max(ok, key=speed), "most output tokens/s"
