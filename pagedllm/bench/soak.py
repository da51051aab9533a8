"""``bench soak``: a long run of mixed traffic against a real ``pagedllm serve`` subprocess.

The server is started on 127.0.0.1 only. ``concurrency`` clients keep it busy with seeded random
requests until ``num_requests`` are done or ``time_limit`` passes: completions and chats, random
sampling parameters, n, stop strings, streamed or not; a ``disconnect_fraction`` of them hang
up part-way (a stream closed after a few chunks, or a non-streamed request given up on) and an
``invalid_fraction`` are bad requests that must be answered 4xx. Reported:

- every status, and any 5xx (for valid and for invalid requests separately);
- the server's RSS over time, and its growth from the end of warm-up (first 10 % of requests)
  to the end of the load;
- ``hostile_rounds`` rounds of hostile input after the mixed traffic (``bench/hostile.py``: 1 MB
  prompts, 960 sequences queued and dropped, every bad body): the server's RSS once idle after
  each round, the highest of them over the RSS before the rounds, the creep per round after the
  first (warm-up) round (the median rise from round to round), and any 5xx;
- KV blocks still in use once the server is idle (``kv_cache_usage_perc`` x the pool);
- p99 end-to-end latency of the first vs the last 10 % of completed requests (drift);
- whether SIGTERM at the end drains and exits 0.

Targets: no 5xx for valid requests, no leaked blocks, RSS growth < 10 %, p99 drift < 20 %; over
the hostile rounds no 5xx, idle RSS within 15 % of the RSS before them, and a creep under
5 MiB per round after the first (at least 3 rounds; 5 or more let one late growth not count).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shlex
import signal
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedllm.bench.hostile import run_rounds, summarize_rounds
from pagedllm.bench.report import machine_info, percentiles, write_json
from pagedllm.bench.server_process import rss_mib, serve_subprocess

TARGETS = {"valid_5xx": 0, "leaked_blocks": 0, "rss_growth_pct": 10.0, "p99_drift_pct": 20.0,
           "hostile_rss_over_before_pct": 15.0, "hostile_rss_creep_mib_per_round": 5.0}
PROMPTS = ["def ", "import os\n", "class Node:\n    def __init__(self", "for i in range(", "return ",
           "# read the file\nwith open(", "if __name__ == ", "    def forward(self, x):\n",
           "x = [", "try:\n    ", "async def main():\n", "print(", "while True:\n    "]
STOPS = ["\n", "):", "    return", "#", "\n\n"]
INVALID = [  # bad bodies: each must be a 4xx, whatever the server's state
    b'{"prompt": "\\ud800def", "max_tokens": 4}',
    b'{"prompt": "def", "max_tokens": 4, "stop": ["\\udfff"]}',
    b'{"prompt": "def", "max_tokens": 8, "stop_token_ids": [99999999], "min_tokens": 3}',
    b'{"prompt": "def", "max_tokens": 8, "stop_token_ids": [-5], "min_tokens": 3}',
    b'{"prompt": [99999999], "max_tokens": 4}',
    b'{"prompt": "def", "max_tokens": 100000}',
    b'{"prompt": "def", "max_tokens": "4"}',
    b'{"prompt": "def", "temperature": -1}',
    b'{"prompt": "def", "n": 0}',
    b'{"prompt": "def", "model": "no-such-model"}',
    b'{"prompt": "def"',
    b'{"prompt": "\xff\xfe"}',
]


@dataclass
class Outcome:
    kind: str  # "valid" | "disconnect" | "invalid"
    status: int | None = None  # HTTP status (None: no response, e.g. hung up before it)
    error: str | None = None  # what went wrong, for a request that should have succeeded
    latency: float | None = None  # end to end, completed valid requests only
    done_at: float = 0.0


@dataclass
class SoakResult:
    outcomes: list[Outcome] = field(default_factory=list)
    rss: list[tuple[float, float]] = field(default_factory=list)  # (seconds, MiB)
    load: list[tuple[float, float]] = field(default_factory=list)  # (seconds, 1-min load average)


def make_request(rng: random.Random, disconnect_fraction: float,
                 invalid_fraction: float) -> tuple[str, str, Any, bool]:
    """(kind, path, body, stream) of one random request; body is bytes for an invalid one."""
    u = rng.random()
    if u < invalid_fraction:
        return "invalid", "/v1/completions", rng.choice(INVALID), False
    kind = "disconnect" if u < invalid_fraction + disconnect_fraction else "valid"
    body: dict[str, Any] = {
        "max_tokens": rng.randint(1, 64), "n": rng.choice([1, 1, 1, 2, 3, 4]),
        "temperature": rng.choice([0.0, 0.5, 0.8, 1.0]), "top_p": rng.choice([1.0, 0.9, 0.5]),
        "top_k": rng.choice([0, 0, 20, 50]), "seed": rng.choice([None, rng.randrange(2**31)]),
        "stream": rng.random() < 0.5,
    }
    if rng.random() < 0.3:
        body["stop"] = rng.sample(STOPS, rng.randint(1, 2))
    if rng.random() < 0.2:
        body["presence_penalty"] = rng.choice([0.5, 1.0])
    text = rng.choice(PROMPTS) + rng.choice(PROMPTS)
    if rng.random() < 0.5:
        body["prompt"] = text
        if rng.random() < 0.2:
            body["logprobs"] = rng.randint(0, 3)
        path = "/v1/completions"
    else:
        body["messages"] = [{"role": "user", "content": text}]
        path = "/v1/chat/completions"
    return kind, path, body, bool(body["stream"])


async def _one(client: Any, rng: random.Random, kind: str, path: str, body: Any, stream: bool,
               t0: float) -> Outcome:
    import httpx

    out = Outcome(kind)
    start = time.monotonic()
    try:
        if kind == "invalid":
            r = await client.post(path, content=body, headers={"Content-Type": "application/json"})
            out.status = r.status_code
            if not 400 <= r.status_code < 500 or "error" not in r.json():
                out.error = f"HTTP {r.status_code}: {r.text[:200]}"
        elif kind == "disconnect" and not stream:
            try:  # give up after a moment: the client's connection closes under the server
                r = await asyncio.wait_for(client.post(path, json=body), rng.uniform(0.005, 0.5))
                out.status = r.status_code
            except asyncio.TimeoutError:
                pass
        elif stream:
            cut = rng.randint(1, 4) if kind == "disconnect" else None
            async with client.stream("POST", path, json=body) as r:
                out.status = r.status_code
                events = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        events += 1
                        if '"error"' in line[:20]:
                            out.error = line[:300]
                        if cut is not None and events >= cut:
                            break  # leaving the block closes the stream mid-way
                    elif line == "data: [DONE]":
                        break
                else:
                    if kind == "valid" and r.status_code == 200:
                        out.error = "the stream ended without [DONE]"
        else:
            r = await client.post(path, json=body)
            out.status = r.status_code
        if kind == "valid" and out.status != 200 and out.error is None:
            out.error = f"HTTP {out.status}"
    except httpx.HTTPError as e:
        if kind != "disconnect":
            out.error = f"{type(e).__name__}: {e}"
    out.done_at = time.monotonic() - t0
    if kind == "valid" and out.error is None:
        out.latency = time.monotonic() - start
    return out


async def _drive(base: str, pid: int, num_requests: int, time_limit: float | None, concurrency: int,
                 seed: int, disconnect_fraction: float, invalid_fraction: float,
                 rss_every: float) -> SoakResult:
    import httpx

    res = SoakResult()
    rng = random.Random(seed)
    t0 = time.monotonic()
    deadline = None if time_limit is None else t0 + time_limit
    issued = 0
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)

    async def sample_rss() -> None:
        while True:
            mib = rss_mib(pid)
            if mib is not None:
                res.rss.append((time.monotonic() - t0, mib))
            res.load.append((time.monotonic() - t0, os.getloadavg()[0]))
            await asyncio.sleep(rss_every)

    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=300) as client:

        async def worker(w: int) -> None:
            nonlocal issued
            wrng = random.Random(seed * 1000 + w)  # disconnect timing, per worker
            while issued < num_requests and (deadline is None or time.monotonic() < deadline):
                issued += 1
                kind, path, body, stream = make_request(rng, disconnect_fraction, invalid_fraction)
                res.outcomes.append(await _one(client, wrng, kind, path, body, stream, t0))

        sampler = asyncio.ensure_future(sample_rss())
        try:
            await asyncio.gather(*(worker(w) for w in range(concurrency)))
        finally:
            sampler.cancel()
        mib = rss_mib(pid)
        if mib is not None:
            res.rss.append((time.monotonic() - t0, mib))
    return res


def _idle_kv(base: str, num_blocks: int, timeout: float = 60) -> tuple[float, int]:
    """(kv_cache_usage_perc, blocks in use) once the server has nothing in flight."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        m: dict[str, float] = {}
        for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
            if line.startswith("pagedllm:"):
                name, value = line.rsplit(" ", 1)
                m[name.split("{")[0]] = m.get(name.split("{")[0], 0.0) + float(value)
        busy = m.get("pagedllm:num_requests_running", 0) + m.get("pagedllm:num_requests_waiting", 0)
        if busy == 0 or time.monotonic() > deadline:
            usage = m.get("pagedllm:kv_cache_usage_perc", 0.0)
            return usage, round(usage * num_blocks)
        time.sleep(0.2)


def summarize(res: SoakResult, leaked: int, usage: float, drained: bool, exit_code: int | None,
              wall: float) -> dict[str, Any]:
    outs = res.outcomes
    done = sorted((o.done_at, o.latency * 1e3) for o in outs if o.latency is not None)
    tenth = max(1, len(done) // 10)
    first = percentiles([ms for _, ms in done[:tenth]])["p99"] if done else 0.0
    last = percentiles([ms for _, ms in done[-tenth:]])["p99"] if done else 0.0
    warm_t = done[tenth - 1][0] if done else 0.0
    warm = next((mib for t, mib in res.rss if t >= warm_t), res.rss[-1][1] if res.rss else None)
    end = res.rss[-1][1] if res.rss else None
    peak = max((mib for t, mib in res.rss if t >= warm_t), default=end)
    growth = None if warm is None or end is None else 100.0 * (end - warm) / warm
    by_kind = Counter(o.kind for o in outs)
    report: dict[str, Any] = {
        "requests": len(outs), "by_kind": dict(by_kind), "wall_s": wall,
        "requests_per_s": len(outs) / wall if wall else 0.0,
        "statuses": dict(Counter(str(o.status) for o in outs)),
        "valid_5xx": sum(1 for o in outs if o.kind != "invalid" and (o.status or 0) >= 500),
        "invalid_5xx": sum(1 for o in outs if o.kind == "invalid" and (o.status or 0) >= 500),
        "failures": len([o for o in outs if o.error]),
        "failure_examples": sorted({o.error for o in outs if o.error})[:10],
        "kv_usage_at_idle": usage, "leaked_blocks": leaked,
        "rss_mib": {"warm": warm, "end": end, "peak_after_warmup": peak,
                    "samples": [[round(t, 1), round(mib, 1)] for t, mib in res.rss]},
        "rss_growth_pct": growth,
        "p99_ms": {"first_10pct": first, "last_10pct": last}, "completed": len(done),
        "p99_drift_pct": 100.0 * (last - first) / first if first else None,
        # the latency drift follows the machine's load on a shared machine: judge it beside this
        "loadavg": {"first_10pct": _mean_between(res.load, 0.0, warm_t),
                    "last_10pct": _mean_between(res.load, done[-tenth][0] if done else 0.0, float("inf")),
                    "samples": [[round(t, 1), round(v, 2)] for t, v in res.load]},
        "drained_exit_code": exit_code, "drained": drained,
    }
    report["targets"] = {
        "valid_5xx": report["valid_5xx"] == 0 and report["failures"] == 0,
        "leaked_blocks": leaked == 0,
        "rss_growth_pct": growth is not None and growth < TARGETS["rss_growth_pct"],
        "p99_drift_pct": report["p99_drift_pct"] is not None
        and report["p99_drift_pct"] < TARGETS["p99_drift_pct"],
        "drain": drained,
    }
    return report


def run_soak(model: str | None, num_requests: int, time_limit: float | None, concurrency: int,
             seed: int, disconnect_fraction: float, invalid_fraction: float, num_kv_blocks: int,
             serve_args: list[str], output_dir: Path, rss_every: float = 2.0,
             hostile_rounds: int = 0) -> dict[str, Any]:
    output_dir.mkdir(parents=True, exist_ok=True)
    args = [*([model] if model else []), "--num-kv-blocks", str(num_kv_blocks), "--log-level",
            "warning", *serve_args]
    env = {"PAGEDLLM_LOG_LEVEL": "WARNING", **os.environ}  # the user's level, else warnings only
    with open(output_dir / "soak-server.log", "w") as log, \
            serve_subprocess(args, log=log, env=env) as (proc, base):
        t0 = time.monotonic()
        res = asyncio.run(_drive(base, proc.pid, num_requests, time_limit, concurrency, seed,
                                 disconnect_fraction, invalid_fraction, rss_every))
        wall = time.monotonic() - t0
        hostile = None
        if hostile_rounds:
            before = rss_mib(proc.pid)
            rounds = asyncio.run(run_rounds(base, hostile_rounds, lambda: rss_mib(proc.pid), INVALID))
            hostile = summarize_rounds(rounds, before)
        usage, leaked = _idle_kv(base, num_kv_blocks)
        proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            code = None
    report = summarize(res, leaked, usage, code == 0, code, wall)
    if hostile is not None:
        report["hostile"] = hostile
        over, creep = hostile["rss_idle_over_before_pct"], hostile["rss_creep_mib_per_round"]
        report["targets"]["hostile_5xx"] = hostile["server_errors"] == 0
        report["targets"]["hostile_rss_flat"] = (
            over is not None and over < TARGETS["hostile_rss_over_before_pct"]
            and creep is not None and creep < TARGETS["hostile_rss_creep_mib_per_round"])
    report["config"] = {"model": model or "default_model", "num_requests": num_requests,
                        "time_limit": time_limit, "concurrency": concurrency, "seed": seed,
                        "disconnect_fraction": disconnect_fraction,
                        "invalid_fraction": invalid_fraction, "num_kv_blocks": num_kv_blocks,
                        "serve_args": serve_args, "hostile_rounds": hostile_rounds}
    report["machine"] = machine_info()
    return report


def format_report(r: dict[str, Any]) -> str:
    t = r["targets"]
    ok = {True: "met", False: "NOT met"}
    rss = r["rss_mib"]
    lines = [
        f"requests: {r['requests']} in {r['wall_s']:.0f} s ({r['requests_per_s']:.1f}/s) "
        f"{r['by_kind']}; statuses {r['statuses']}",
        f"5xx for valid requests: {r['valid_5xx']}, other failures: {r['failures']} "
        f"(5xx for invalid: {r['invalid_5xx']})  [{ok[t['valid_5xx']]}]",
        f"KV blocks in use at idle: {r['leaked_blocks']}  [{ok[t['leaked_blocks']]}]",
        f"RSS MiB: warm {_mib(rss['warm'])}, end {_mib(rss['end'])}, peak after warm-up "
        f"{_mib(rss['peak_after_warmup'])}; growth {_pct(r['rss_growth_pct'])}  [{ok[t['rss_growth_pct']]}]",
        "RSS over time (s: MiB): " + ", ".join(f"{s:.0f}: {m:.0f}" for s, m in _spread(rss["samples"])),
        f"p99 e2e ms: first 10 % {r['p99_ms']['first_10pct']:.0f}, last 10 % "
        f"{r['p99_ms']['last_10pct']:.0f}; drift {_pct(r['p99_drift_pct'])}  [{ok[t['p99_drift_pct']]}]",
        f"1-min load average while the first / last 10 % ran: {_num(r['loadavg']['first_10pct'])} / "
        f"{_num(r['loadavg']['last_10pct'])} ({os.cpu_count()} CPUs)",
        f"SIGTERM drain: exit code {r['drained_exit_code']}  [{ok[t['drain']]}]",
    ]
    h = r.get("hostile")
    if h is not None:
        lines.append(
            f"hostile rounds: RSS MiB idle before {_mib(h['rss_before_mib'])}, after each round "
            + ", ".join(_mib(x["rss_idle_mib"]) for x in h["rounds"])
            + f" (peaks {', '.join(_mib(x['rss_peak_mib']) for x in h['rounds'])}); highest "
            f"{_pct(h['rss_idle_over_before_pct'])} over before, creep after the first round "
            f"{_num(h['rss_creep_mib_per_round'])} MiB/round  [{ok[t['hostile_rss_flat']]}]; "
            f"5xx {h['server_errors']}  [{ok[t['hostile_5xx']]}]")
    for e in r["failure_examples"]:
        lines.append(f"  failure: {e}")
    return "\n".join(lines)


def _mean_between(samples: list[tuple[float, float]], start: float, end: float) -> float | None:
    vals = [v for t, v in samples if start <= t <= end]
    return sum(vals) / len(vals) if vals else None


def _num(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f}"


def _mib(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0f}"


def _spread(samples: list[list[float]], k: int = 10) -> list[list[float]]:
    """At most ``k`` samples, evenly spaced, the last one included."""
    if len(samples) <= k:
        return samples
    step = (len(samples) - 1) / (k - 1)
    return [samples[round(i * step)] for i in range(k)]


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:+.1f} %"


COMMAND = "soak"
HELP = ("long mixed traffic (random sampling, n, stops, disconnects, bad requests) against a "
        "`pagedllm serve` subprocess: 5xx, RSS, idle KV blocks, p99 drift")


def add_cli_args(p: Any) -> None:
    """Soak's own flags, and the engine's --model (the checkpoint served), --seed (the
    traffic's) and --num-kv-blocks (the server's pool: explicit, so idle blocks can be
    counted; default 1024)."""
    from pagedllm.args import EngineArgs

    p.add_argument("--num-requests", type=int, default=20000)
    p.add_argument("--time-limit", type=float, default=None,
                   help="stop issuing requests after this many seconds (report N reached)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight at all times")
    p.add_argument("--disconnect-fraction", type=float, default=0.10)
    p.add_argument("--invalid-fraction", type=float, default=0.05)
    p.add_argument("--hostile-rounds", type=int, default=8,
                   help="rounds of hostile input after the traffic, RSS sampled idle after each "
                   "(0: none)")
    p.add_argument("--serve-args", default="", help="more `pagedllm serve` flags, one string")
    p.add_argument("--output-dir", type=Path, default=Path("bench-results"))
    EngineArgs.add_cli_args(p, only=("model", "seed", "num_kv_blocks"))
    p.set_defaults(num_kv_blocks=1024)


def run(a: Any) -> int:
    report = run_soak(a.model, a.num_requests, a.time_limit, a.concurrency, a.seed,
                      a.disconnect_fraction, a.invalid_fraction, a.num_kv_blocks,
                      shlex.split(a.serve_args), a.output_dir, hostile_rounds=a.hostile_rounds)
    path = write_json(a.output_dir / "soak.json", report)
    print(format_report(report))
    print(f"wrote {path}")
    print(json.dumps(report["targets"]))
    return 0 if all(report["targets"].values()) else 1
