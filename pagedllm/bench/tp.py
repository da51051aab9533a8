"""``bench tp``: TP=1 vs TP=N: tokens/s, and what each step spends on communication.

    pagedllm bench tp [--model DIR] [--tp 1,2] [--num-prompts 8]
        [--prompt-len 64] [--max-tokens 32] [--json out.json]

Every run uses the same prompts (the seeded ``fixed`` workload) and greedy decoding; after each
step (``engine.drive``'s ``on_step``) its all-reduce bytes/time and control bytes/time (rank 0's
view) are recorded, split into steps with prefill tokens and pure decode steps (from the step's
record). Sizes run interleaved, ``--reps`` times each (``bench.harness``), the fastest run
reported. Threads: TP=1 uses every core; TP=N gives
each rank cores/N (rank 0 in this process, the workers likewise).

Cost model of one step of T tokens on N ranks: 2 all-reduces per layer of a [T, hidden] tensor,
so ``2 * L * T * hidden * bytes(dtype)`` bytes enter the all-reduces per rank (a ring moves about
2(N-1)/N times that over the wire), plus one control message with the step's metadata
(token ids, positions, slots, block tables: a few hundred bytes to a few KiB). Measured seconds
include waiting for the slower rank, so on a loaded machine they are an upper bound on the wire time.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from pagedllm.bench.harness import interleaved

COMMAND = "tp"
HELP = "tensor parallelism: TP=1 vs TP=N tokens/s and per-step communication"


@dataclass
class StepKind:
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    allreduce_calls: int = 0
    allreduce_bytes: int = 0
    allreduce_seconds: float = 0.0
    control_bytes: int = 0
    control_seconds: float = 0.0

    def per_step(self) -> dict[str, float]:
        n = max(self.steps, 1)
        return {
            "steps": self.steps,
            "tokens_per_step": self.tokens / n,
            "step_ms": 1e3 * self.seconds / n,
            "allreduce_calls_per_step": self.allreduce_calls / n,
            "allreduce_kib_per_step": self.allreduce_bytes / n / 1024,
            "allreduce_ms_per_step": 1e3 * self.allreduce_seconds / n,
            "control_kib_per_step": self.control_bytes / n / 1024,
            "control_ms_per_step": 1e3 * self.control_seconds / n,
        }


@dataclass
class TPResult:
    tensor_parallel_size: int
    threads_per_rank: int
    wall_s: float
    output_tokens: int
    prompt_tokens: int
    output_tokens_per_s: float
    total_tokens_per_s: float
    prefill: dict[str, float] = field(default_factory=dict)
    decode: dict[str, float] = field(default_factory=dict)
    predicted_allreduce_bytes_per_token: int = 0


def run_tp(model: str, tp: int, num_prompts: int, prompt_len: int, max_tokens: int,
           threads: int | None = None, **engine_kwargs: Any) -> TPResult:
    """``threads``: torch threads of rank 0 (default: cores / tp); workers use cores / tp."""
    import torch

    from pagedllm.bench.workload import BenchRequest, WorkloadSpec, make_workload, submissions
    from pagedllm.engine import LLMEngine
    from pagedllm.engine.drive import drive

    cores = os.cpu_count() or 1
    threads = threads or max(1, cores // tp)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    engine = LLMEngine.from_args(model=model, tensor_parallel_size=tp, **engine_kwargs)
    try:
        cfg = engine.config
        spec = WorkloadSpec("fixed", num_prompts, max_model_len=cfg.scheduler.max_model_len,
                            input_len=prompt_len, output_len=max_tokens)
        reqs = make_workload(spec, list(range(cfg.model.vocab_size)))
        drive(engine, submissions(engine, [BenchRequest(reqs[0].prompt_token_ids[:8], 2)],
                                  prefix="warmup"))
        stats = getattr(engine.executor, "comm_stats", None)
        kinds = {"prefill": StepKind(), "decode": StepKind()}
        last: dict[str, Any] = asdict(stats) if stats is not None else {}  # the counters so far

        def on_step(outs: list[Any]) -> None:
            rec = engine.stats
            k = kinds["decode" if rec.num_scheduled_tokens == rec.num_scheduled_requests
                      else "prefill"]
            k.steps += 1
            k.tokens += rec.num_scheduled_tokens
            k.seconds += rec.step_time_s
            if stats is not None:
                now = asdict(stats)
                for f in ("allreduce_calls", "allreduce_bytes", "allreduce_seconds",
                          "control_bytes", "control_seconds"):
                    setattr(k, f, getattr(k, f) + now[f] - last[f])
                last.update(now)

        wall = drive(engine, submissions(engine, reqs, prefix="b"), on_step=on_step).elapsed
        m = engine.config.model
        elem = m.dtype_bytes
        out_total = num_prompts * max_tokens
        prompt_total = num_prompts * prompt_len
        return TPResult(
            tensor_parallel_size=tp, threads_per_rank=threads, wall_s=wall,
            output_tokens=out_total, prompt_tokens=prompt_total,
            output_tokens_per_s=out_total / wall, total_tokens_per_s=(out_total + prompt_total) / wall,
            prefill=kinds["prefill"].per_step(), decode=kinds["decode"].per_step(),
            predicted_allreduce_bytes_per_token=2 * m.num_hidden_layers * m.hidden_size * elem if tp > 1 else 0,
        )
    finally:
        engine.shutdown()
        torch.set_num_threads(old_threads)


def add_cli_args(ap: argparse.ArgumentParser) -> None:
    from pagedllm.args import EngineArgs
    from pagedllm.bench.command import int_list

    ap.add_argument("--tp", type=int_list, default=(1, 2), help="comma-separated tensor-parallel sizes")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads of the engine process (default: cores / tp)")
    ap.add_argument("--reps", type=int, default=1, help="runs per size; the fastest is reported")
    ap.add_argument("--json", default=None, help="also write the results here")
    EngineArgs.add_cli_args(ap, only=("model", "block_size"))


def main(argv: list[str] | None = None) -> int:
    """``python -m pagedllm.bench.tp`` (the same as ``pagedllm bench tp``)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cli_args(ap)
    return run(ap.parse_args(argv))


def run(a: argparse.Namespace) -> int:
    from pagedllm.config import default_model_path

    sizes = list(a.tp)
    model = a.model or default_model_path()

    def one(tp: int) -> TPResult:
        return run_tp(model, tp, a.num_prompts, a.prompt_len, a.max_tokens, a.threads,
                      block_size=a.block_size, max_model_len=a.prompt_len + a.max_tokens + 8)

    results = []
    for tp, runs in zip(sizes, interleaved(sizes, one, a.reps)):
        r = min(runs, key=lambda x: x.wall_s)  # the fastest (bench.harness)
        results.append(r)
        d = r.decode
        print(f"TP={tp} ({r.threads_per_rank} thread(s)/rank): {r.output_tokens_per_s:7.1f} output tok/s, "
              f"{r.total_tokens_per_s:7.1f} total tok/s, wall {r.wall_s:.2f}s")
        for name, k in (("prefill", r.prefill), ("decode", d)):
            print(f"  {name:7s} {k['steps']:4d} steps, {k['tokens_per_step']:6.1f} tok/step, "
                  f"{k['step_ms']:7.2f} ms/step; all-reduce {k['allreduce_calls_per_step']:.0f} calls "
                  f"{k['allreduce_kib_per_step']:8.1f} KiB {k['allreduce_ms_per_step']:6.2f} ms; "
                  f"control {k['control_kib_per_step']:.2f} KiB {k['control_ms_per_step']:.3f} ms")
        if tp > 1:
            print(f"  model: {r.predicted_allreduce_bytes_per_token} all-reduce bytes per token per rank")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump([asdict(r) for r in results], f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
