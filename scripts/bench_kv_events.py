"""What the KV event bus costs on the KV manager's hot path (decode: allocate_slots + cache_blocks
for 128 requests, 10 steps a run): nobody listening, a cache-event listener, an op listener;
with ``--baseline CHECKOUT`` also that checkout's KV manager (its ``pagedllm/kv`` copied into a
temporary package), all in one process. Many short runs, interleaved, the fastest of each kept:
on a shared machine only the side-by-side ratios mean anything.

    python scripts/bench_kv_events.py [--baseline ../main] [--runs 150]
"""

from __future__ import annotations

import argparse
import importlib
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pagedllm.kv.manager import KVCacheManager


def baseline_manager(checkout: Path) -> Any:
    """``KVCacheManager`` of another checkout, imported as ``pagedllm_baseline.kv.manager``."""
    root = Path(tempfile.mkdtemp()) / "pagedllm_baseline"
    shutil.copytree(checkout / "pagedllm" / "kv", root / "kv")
    (root / "__init__.py").write_text("")
    for f in (root / "kv").glob("*.py"):
        f.write_text(re.sub(r"\bpagedllm\.kv\b", "pagedllm_baseline.kv", f.read_text()))
    sys.path.insert(0, str(root.parent))
    return importlib.import_module("pagedllm_baseline.kv.manager").KVCacheManager


def setup(cls: Any, listen: str | None) -> tuple[Any, dict[str, list[int]]]:
    kv = cls(4096, 16)
    if listen is not None:
        kv.events.subscribe(lambda e: None, ops=listen == "ops")
    toks = {f"r{i}": list(range(i, i + 300)) for i in range(128)}
    for rid, t in toks.items():
        kv.allocate_slots(rid, len(t))
        kv.cache_blocks(rid, t, len(t))
    return kv, toks


def run(kv: Any, toks: dict[str, list[int]], step0: int) -> float:
    """Microseconds per request-step of 10 decode steps."""
    t0 = time.perf_counter()
    for step in range(step0, step0 + 10):
        for rid, t in toks.items():
            t.append(step)
            kv.allocate_slots(rid, len(t))
            kv.cache_blocks(rid, t, len(t))
    return (time.perf_counter() - t0) / (10 * len(toks)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout to compare")
    ap.add_argument("--runs", type=int, default=150)
    args = ap.parse_args()
    cases: dict[str, tuple[Any, str | None]] = {}
    if args.baseline is not None:
        cases["baseline"] = (baseline_manager(args.baseline), None)
    cases |= {"no listener": (KVCacheManager, None), "cache listener": (KVCacheManager, "cache"),
              "op listener": (KVCacheManager, "ops")}
    states = {k: setup(*v) for k, v in cases.items()}
    best = dict.fromkeys(cases, float("inf"))
    for i in range(args.runs):
        for k, (kv, toks) in states.items():
            best[k] = min(best[k], run(kv, toks, i * 10))
    ref = best["baseline" if args.baseline is not None else "no listener"]
    for k, v in best.items():
        print(f"{k:>15}: {v:.3f} us per request-step ({v / ref:.3f}x)")


if __name__ == "__main__":
    main()
