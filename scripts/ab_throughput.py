"""Old vs new pagedllm on the `bench throughput` workload, interleaved.

Two checkouts (``--old DIR --new DIR``): each repetition runs each checkout in a fresh process
(``PYTHONPATH=<checkout>``, this Python), alternating which goes first; a process builds the
engine, warms up on 2 requests, then times the whole workload once. ``--fused-ops``: one process
of this checkout, one engine, the workload run alternately with the fused CPU elementwise ops
off (old: the torch ops) and on (new). Reports wall-clock and process CPU time: on a machine
other jobs share, CPU time (all of the process's threads) is the steadier figure for a
one-thread run. Greedy outputs must be identical across all runs.

    python scripts/ab_throughput.py --old /tmp/main-checkout --new . --model DIR --rounds 3
    python scripts/ab_throughput.py --fused-ops --model DIR --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import hashlib, json, sys, time
import torch
a = json.loads(sys.argv[1])
torch.set_num_threads(a["threads"])
from pagedllm import kernels
from pagedllm.bench.baselines import make_backend
from pagedllm.bench.workload import build_workload
kw = {k: v for k, v in a["engine"].items() if v is not None}
spec, reqs, _ = build_workload(kw, {"kind": "longtail", "num_prompts": a["num_prompts"],
                                    "seed": a["seed"]})
backend = make_backend("pagedllm", kw, 16)
backend.run(reqs[:2])
fused = kernels.fused
for r in range(a["rounds"]):  # one round (two runs) without --fused-ops
    for name in (("old", "new") if r % 2 == 0 else ("new", "old"))[: a["runs"]]:
        kernels.fused = fused if name == "new" else (lambda *t: False)
        c0, w0 = time.process_time(), time.perf_counter()
        res = backend.run(reqs)
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        print(json.dumps({"name": name, "wall_s": wall, "cpu_s": cpu,
                          "output_tokens": res.output_tokens,
                          "outputs": hashlib.sha1(json.dumps(res.outputs).encode()).hexdigest()}),
              flush=True)
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old", help="checkout (repository root) of the old code")
    p.add_argument("--new", help="checkout of the new code")
    p.add_argument("--fused-ops", action="store_true",
                   help="in one process: the fused CPU elementwise ops off (old) vs on (new)")
    p.add_argument("--model", default=None, help="checkpoint (default: the shipped model)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--kv-cache-memory", default="4GiB")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if a.fused_ops == bool(a.old and a.new):
        p.error("give --old and --new, or --fused-ops")
    child = {"threads": a.threads, "num_prompts": a.num_prompts, "seed": a.seed,
             "engine": {"model": a.model, "dtype": a.dtype, "kv_cache_memory": a.kv_cache_memory}}
    runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    outputs = set()

    def spawn(tree: str, rounds: int, per_round: int, order: tuple[str, ...]) -> None:
        env = {**os.environ, "PYTHONPATH": os.path.abspath(tree), "PAGEDLLM_LOG_LEVEL": "WARNING"}
        arg = json.dumps({**child, "rounds": rounds, "runs": per_round})
        proc = subprocess.Popen([sys.executable, "-c", CHILD, arg], env=env, text=True,
                                stdout=subprocess.PIPE)
        assert proc.stdout is not None
        for line in proc.stdout:
            res = json.loads(line)
            name = res.pop("name") if per_round == 2 else order[0]
            outputs.add(res.pop("outputs"))
            runs[name].append(res)
            print(f"{name}: {res['output_tokens'] / res['wall_s']:.1f} out tok/s wall, "
                  f"{res['output_tokens'] / res['cpu_s']:.1f} per CPU second", flush=True)
        if proc.wait() != 0:
            raise SystemExit(f"the benchmark process failed (exit {proc.returncode})")

    if a.fused_ops:
        spawn(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), a.rounds, 2,
              ("old", "new"))
    else:
        for r in range(a.rounds):
            for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
                spawn(getattr(a, name), 1, 1, (name,))
    med = {n: {k: statistics.median(x["output_tokens"] / x[k] for x in rs)
               for k in ("wall_s", "cpu_s")} for n, rs in runs.items()}
    for k, label in (("wall_s", "wall"), ("cpu_s", "CPU time")):
        print(f"{label}: old {med['old'][k]:.1f}, new {med['new'][k]:.1f} out tok/s (medians), "
              f"new/old {med['new'][k] / med['old'][k]:.3f}x")
    print("greedy outputs identical across all runs" if len(outputs) == 1
          else f"OUTPUTS DIFFER: {len(outputs)} distinct")
    return 0 if len(outputs) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
