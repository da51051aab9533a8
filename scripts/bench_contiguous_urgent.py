"""Does ``contiguous_urgent`` (consecutive block ids for the urgent class) pay on this machine?

Two engines on the shipped default model, identical but for the option, run the same random
workload (every request priority 0, i.e. urgent) in interleaved repetitions. Reported per engine:

  contiguity   fraction of adjacent block-table entries (i, i+1) holding ids (b, b+1), over the
               tables of every scheduled decode, every step
  elapsed_s    wall time of the fastest repetition (output tokens/s from it)
  decode_attn  seconds inside ``CpuBackend._decode`` (the whole-block index_select gather plus
               the attention math) in that repetition

plus a micro-benchmark of ``gather_blocks`` alone with a consecutive vs a shuffled table.

    PYTHONPATH=. python3 scripts/bench_contiguous_urgent.py --threads 1
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from pagedllm.attention.cpu import CpuBackend, gather_blocks
from pagedllm.bench.baselines import EngineBackend
from pagedllm.bench.workload import build_workload

_attn_s = [0.0]  # time inside CpuBackend._decode since the last reset (one engine runs at once)


def _timed_decode() -> None:
    inner = CpuBackend._decode

    def wrapper(self: CpuBackend, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(self, *args, **kwargs)
        finally:
            _attn_s[0] += time.perf_counter() - t0

    CpuBackend._decode = wrapper  # type: ignore[method-assign]


def _count_contiguity(backend: EngineBackend, counts: list[int]) -> None:
    """Wrap the engine's scheduler so each step adds (consecutive pairs, pairs) to ``counts``."""
    sched = backend.engine.scheduler
    inner = sched.schedule

    def schedule() -> Any:
        out = inner()
        for s in out.scheduled:
            if s.num_new_tokens == 1:
                t = s.block_table
                counts[0] += sum(1 for a, b in zip(t, t[1:]) if b == a + 1)
                counts[1] += max(len(t) - 1, 0)
        return out

    sched.schedule = schedule  # type: ignore[method-assign]


def gather_micro(block_size: int, num_kv_heads: int, head_dim: int, blocks: int,
                 reps: int = 200) -> dict[str, float]:
    """µs per ``gather_blocks`` of ``blocks`` blocks: consecutive ids vs a random permutation."""
    pool = torch.randn(4 * blocks, block_size, num_kv_heads, head_dim)
    out: dict[str, float] = {}
    g = torch.Generator().manual_seed(0)
    tables = {"consecutive": torch.arange(blocks, 2 * blocks),
              "shuffled": torch.randperm(4 * blocks, generator=g)[:blocks]}
    for name, idx in tables.items():
        gather_blocks(pool, idx)
        t0 = time.perf_counter()
        for _ in range(reps):
            gather_blocks(pool, idx)
        out[name] = (time.perf_counter() - t0) / reps * 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    base: dict[str, Any] = dict(max_num_seqs=a.max_num_seqs, seed=a.seed)
    spec, reqs, cfg = build_workload(base, dict(num_prompts=a.num_prompts, seed=a.seed))
    _timed_decode()
    names = ("off", "on")
    engines = {n: EngineBackend(f"contiguous_urgent={n}", {**base, "contiguous_urgent": n == "on"})
               for n in names}
    counts = {n: [0, 0] for n in names}
    for n in names:
        engines[n].run(reqs[:4])  # warm-up
        _count_contiguity(engines[n], counts[n])
    runs: dict[str, list[tuple[float, float, int]]] = {n: [] for n in names}
    outputs: dict[str, list[list[int]]] = {}
    for rep in range(a.reps):
        for n in (names if rep % 2 == 0 else names[::-1]):
            _attn_s[0] = 0.0
            r = engines[n].run(reqs)
            runs[n].append((r.elapsed_s, _attn_s[0], r.output_tokens))
            outputs.setdefault(n, r.outputs)
    m = cfg.model
    rows = {}
    for n in names:
        el, attn, toks = min(runs[n])
        rows[n] = {"contiguity": counts[n][0] / max(counts[n][1], 1), "elapsed_s": el,
                   "output_tokens_per_s": toks / el, "decode_attn_s": attn,
                   "elapsed_s_all": [x[0] for x in runs[n]],
                   "decode_attn_s_all": [x[1] for x in runs[n]]}
    result = {"model": str(cfg.tokenizer), "threads": a.threads,
              "num_prompts": a.num_prompts, "reps": a.reps, "block_size": cfg.cache.block_size,
              "outputs_identical": outputs["on"] == outputs["off"], "engines": rows,
              "gather_us_16_blocks": gather_micro(cfg.cache.block_size, m.num_key_value_heads,
                                                  m.head_dim, 16)}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
