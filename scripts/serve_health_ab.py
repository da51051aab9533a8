"""/health latency and served output tok/s of `pagedllm serve` under N streaming requests at
once, for one or more source trees side by side (e.g. main and a branch), alternating.

Each run: `pagedllm serve --max-num-seqs 64` (the shipped model) from TREE (its PYTHONPATH), a
thread polling /health every 50 ms, and `pagedllm bench serve --workload fixed --input-len 64
--output-len 128 --num-prompts N` against it; reported: output tok/s, /health p50/p99 and the
slowest answers (ms, with when they came) over the bench command's run, and the CPU seconds of
the server process and of its engine-core child (if any).

    python scripts/serve_health_ab.py /work/main /work/wt/h-core [--reps 2] [--num-prompts 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))


def _cpu_s(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def run_once(tree: str, num_prompts: int, seed: int) -> dict[str, Any]:
    import httpx
    from serve_process import child_pids

    from pagedllm.bench.server_process import serve_subprocess

    env = {**os.environ, "PYTHONPATH": tree, "PAGEDLLM_LOG_LEVEL": "WARNING"}
    os.chdir(tree)  # `python -m` puts the working directory first on sys.path, before PYTHONPATH
    with serve_subprocess(["--max-num-seqs", "64", "--log-level", "warning"], env=env,
                          timeout=300) as (proc, base):
        cores = [p for p in child_pids(proc.pid)
                 if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
        lat: list[tuple[float, float]] = []
        stop = threading.Event()
        t00 = time.perf_counter()

        def poll() -> None:
            with httpx.Client() as c:
                while not stop.is_set():
                    t0 = time.perf_counter()
                    c.get(base + "/health", timeout=30)
                    lat.append(((time.perf_counter() - t0) * 1000, t0 - t00))
                    time.sleep(0.05)

        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "serve.json"
            cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "serve",
                   "--base-url", base, "--workload", "fixed", "--input-len", "64",
                   "--output-len", "128", "--num-prompts", str(num_prompts), "--seed", str(seed),
                   "--output-json", str(out), "--no-plot"]
            c0 = (_cpu_s(proc.pid), sum(_cpu_s(p) for p in cores))
            poller = threading.Thread(target=poll)
            poller.start()
            start = time.perf_counter() - t00
            subprocess.run(cmd, env=env, check=True, capture_output=True)
            end = time.perf_counter() - t00
            stop.set()
            poller.join()
            c1 = (_cpu_s(proc.pid), sum(_cpu_s(p) for p in cores))
            bench = json.loads(out.read_text())
    window = sorted(ms for ms, at in lat if start <= at <= end)
    return {
        "output_tok_s": round(bench["output_throughput"], 1),
        "health_p50_ms": round(window[len(window) // 2], 1),
        "health_p99_ms": round(window[min(len(window) - 1, int(0.99 * len(window)))], 1),
        "health_slowest_ms_at_s": [(round(ms), round(at - start, 1)) for ms, at in
                                   sorted(lat, reverse=True)[:3]],
        "cpu_s_server": round(c1[0] - c0[0], 2),
        "cpu_s_core": round(c1[1] - c0[1], 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trees", nargs="+", help="source trees to serve from (PYTHONPATH)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=64)
    a = ap.parse_args()
    for rep in range(a.reps):
        order = a.trees if rep % 2 == 0 else list(reversed(a.trees))
        for tree in order:
            print(json.dumps({"tree": tree, "rep": rep, **run_once(tree, a.num_prompts, rep)}),
                  flush=True)


if __name__ == "__main__":
    main()
