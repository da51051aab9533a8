"""``bench throughput``: offline generation of one workload on several backends, interleaved.

Every backend is built once (weights loaded, KV pool allocated), warmed up on a few requests,
then the workload runs ``reps`` times per backend, interleaved (``bench.harness``): rates come
from each backend's fastest repetition; the median time is kept in the JSON as well. Targets
(pagedllm vs HF and vs contiguous) are the README's, not judged here.

All backends run on the engine kwargs' ``device`` (``--device cuda``: the engine, the contiguous
baseline and HF generate on the same GPU; see ``baselines`` for the dtype HF uses).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from pagedllm.bench.baselines import BACKENDS, make_backend, parse_backend, split_backends
from pagedllm.bench.command import add_workload_command_args, show, workload
from pagedllm.bench.device import device_name
from pagedllm.bench.harness import interleaved, timing
from pagedllm.bench.report import format_table, machine_info, plot, write_json
from pagedllm.bench.vllm_backend import find_vllm_python, make_vllm_backend
from pagedllm.bench.workload import BenchRequest, WorkloadSpec, summarize, write_trace

COLUMNS = ("backend", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s", "elapsed_s",
           "peak_running", "num_preemptions", "num_steps", "kv_utilization")

COMMAND = "throughput"
HELP = ("offline throughput: pagedllm vs HF transformers vs contiguous reservation (vs vLLM when "
        "installed), interleaved")
DESCRIPTION = ("All backends run on --device at the dtype the engine resolves from --dtype "
               "(auto = the checkpoint's); on a GPU pass --device cuda --dtype bfloat16.")


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backends", default=None,
                   help="comma-separated: pagedllm, pagedllm-json, hf, contiguous, vllm (default: "
                   "pagedllm,hf,contiguous, plus vllm when --vllm-python, $PAGEDLLM_VLLM_PYTHON "
                   "or this Python has vllm); a variant 'pagedllm[max_num_seqs=128,fused_ops="
                   "false]' runs the engine with those settings, interleaved with the others")
    p.add_argument("--vllm-python", default=None,
                   help="the Python of a venv with vllm installed (its own torch); the vllm "
                   "backend runs there in a subprocess (default: $PAGEDLLM_VLLM_PYTHON)")
    p.add_argument("--vllm-kwargs", type=json.loads, default=None,
                   help="JSON object of extra vllm.LLM arguments, e.g. '{\"max_num_seqs\": 64}' "
                   "(default: vLLM's own defaults; dtype and max_model_len follow the engine)")
    p.add_argument("--lora-adapters", type=int, default=0, metavar="N",
                   help="request i runs random LoRA adapter i mod N (rank --max-lora-rank on every "
                   "projection) on the pagedllm backends with LoRA on (--enable-lora, or "
                   "pagedllm[enable_lora=true] beside the base: 'pagedllm,pagedllm[enable_lora=true]')")
    p.add_argument("--reps", type=int, default=3, help="repetitions per backend (the fastest is reported)")
    p.add_argument("--hf-batch-size", type=int, default=16, help="HF generate static batch size")
    p.add_argument("--warmup", type=int, default=4, help="requests in each backend's warm-up run")
    p.add_argument("--json-schema", default=None, metavar="FILE", help="backend pagedllm-json: "
                   "this schema on every request (default: records that run to max_tokens)")
    p.add_argument("--record-trace", default=None, metavar="FILE",
                   help="write the workload as a trace JSONL with the tokens the first pagedllm "
                   "backend generated (its first repetition): `pagedllm plan --trace FILE` then "
                   "replays them token for token, speculative decoding included")
    add_workload_command_args(p, 64)


def run(a: argparse.Namespace) -> int:
    if a.backends is None:
        a.backends = "pagedllm,hf,contiguous" + (",vllm" if find_vllm_python(a.vllm_python) else "")
    names = split_backends(a.backends)
    bad = [b for b in names if parse_backend(b)[0] not in BACKENDS]
    if bad or not names or len(set(names)) != len(names):
        raise ValueError(f"--backends {a.backends!r}: choose distinct names from {', '.join(BACKENDS)}")
    kw, spec, reqs, _ = workload(a)
    if a.lora_adapters:
        lora = [b for b in names if {**kw, **parse_backend(b)[1]}.get("enable_lora")]
        if not lora or any(not b.startswith("pagedllm") for b in names):
            raise ValueError("--lora-adapters runs on pagedllm backends only, at least one with "
                             "LoRA on (--enable-lora or pagedllm[enable_lora=true])")
        reqs = [replace(r, lora_id=1 + i % a.lora_adapters) for i, r in enumerate(reqs)]
    schema = None if a.json_schema is None else json.loads(Path(a.json_schema).read_text())
    res = run_throughput(reqs, spec, kw, names, a.reps, a.hf_batch_size, a.warmup,
                         a.vllm_python, a.vllm_kwargs, schema, a.record_trace)
    res["workload"]["lora_adapters"] = a.lora_adapters
    return show(report_throughput(res, a.output_dir, a.output_json, a.plot))


def run_throughput(
    reqs: list[BenchRequest],
    spec: WorkloadSpec,
    engine_kwargs: dict[str, Any],
    backends: list[str],
    reps: int = 3,
    hf_batch_size: int = 16,
    warmup: int = 4,
    vllm_python: str | None = None,
    vllm_kwargs: dict[str, Any] | None = None,
    json_schema: dict[str, Any] | None = None,
    record_trace: str | None = None,
) -> dict[str, Any]:
    """``json_schema``: the schema of backend ``pagedllm-json`` (default ``BENCH_SCHEMA``);
    ``record_trace``: a trace file of ``reqs`` with what the first pagedllm backend generated."""
    if record_trace is not None and all(parse_backend(b)[0] in ("hf", "vllm") for b in backends):
        raise ValueError("--record-trace needs a pagedllm backend")  # before any run, not after
    built: list[Any] = []
    try:
        for b in backends:
            built.append(make_vllm_backend(engine_kwargs, vllm_python, vllm_kwargs) if b == "vllm"
                         else make_backend(b, engine_kwargs, hf_batch_size, json_schema))
        warm = (lambda b: b.run(reqs[:warmup])) if warmup else None
        runs = dict(zip(backends, interleaved(built, lambda b: b.run(reqs), reps, warm)))
    finally:  # a subprocess backend (vllm) goes, with its children, even on an interrupt
        for b in built:
            if hasattr(b, "close"):
                b.close()

    if record_trace is not None:  # the first engine backend's first repetition
        write_trace(record_trace, reqs,
                    next(rs[0].sequences for rs in runs.values() if rs[0].sequences is not None))
    results = [_row(name, runs[name]) for name in backends]
    ref = "pagedllm" if "pagedllm" in backends else backends[0]
    by = {r["backend"]: r for r in results}
    ratios = {
        f"{ref}/{name}": {k: by[ref][k] / by[name][k] for k in
                          ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s",
                           "output_tokens_per_cpu_s") if k in by[ref] and k in by[name]}
        for name in backends if name != ref
    }
    first = {name: runs[name][0].outputs for name in backends}
    agreement = {
        f"{ref}/{name}": _match(first[ref], first[name]) for name in backends if name != ref
    }
    device = str(engine_kwargs.get("device") or "cpu")
    return {
        "benchmark": "throughput",
        "device": device,
        "device_name": device_name(device),
        "results": results,
        "ratios": ratios,
        "greedy_output_agreement": agreement,
        "reps": reps,
        "order": "interleaved: rep r runs backends rotated by r",
        "hf_batch_size": hf_batch_size if "hf" in backends else None,
        "workload": {**spec.describe(), **summarize(reqs)},
        "engine": {k: v for k, v in engine_kwargs.items() if v is not None},
        "machine": machine_info(),
    }


def _row(name: str, rs: list[Any]) -> dict[str, Any]:
    """One backend's result row: its fastest repetition, timings over all of them."""
    best = min(rs, key=lambda r: r.elapsed_s)  # the fastest repetition (bench.harness)
    t = best.elapsed_s
    row: dict[str, Any] = {
        "backend": name,
        "requests_per_s": best.num_requests / t,
        "output_tokens_per_s": best.output_tokens / t,
        "total_tokens_per_s": (best.prompt_tokens + best.output_tokens) / t,
        **timing([r.elapsed_s for r in rs]),
        "num_requests": best.num_requests,
        "prompt_tokens": best.prompt_tokens,
        "output_tokens": best.output_tokens,
        "generated_tokens": best.generated_tokens,
        **best.stats,
    }
    if all(r.stats.get("cpu_s", 0) > 0 for r in rs):  # CPU time of the backend's processes
        row["cpu_s"] = min(r.stats["cpu_s"] for r in rs)
        row["cpu_s_all"] = [r.stats["cpu_s"] for r in rs]
        row["output_tokens_per_cpu_s"] = best.output_tokens / row["cpu_s"]
    if all("machine_cpu_s" in r.stats and "cpu_s" in r.stats for r in rs):
        # what every other process used meanwhile (another backend's idle processes too)
        row["other_cpu_s_all"] = [max(0.0, r.stats["machine_cpu_s"] - r.stats["cpu_s"])
                                  for r in rs]
    return row


def _match(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of requests whose greedy outputs are identical."""
    return sum(x == y for x, y in zip(a, b)) / len(a) if a else 1.0


def report_throughput(res: dict[str, Any], output_dir: Path, output_json: Path | None,
                      make_plots: bool = True) -> list[Path]:
    dtype = res["engine"].get("dtype", "auto")
    print(f"device {res.get('device_name') or res.get('device', 'cpu')}, dtype {dtype}")
    print(format_table(res["results"], COLUMNS,
                       ["backend", "req/s", "out tok/s", "total tok/s", "time s", "peak run",
                        "preempt", "steps", "KV util"]))
    for pair, r in res["ratios"].items():
        cpu = (f", output tok per CPU s x{r['output_tokens_per_cpu_s']:.2f}"
               if "output_tokens_per_cpu_s" in r else "")
        print(f"{pair}: output tok/s x{r['output_tokens_per_s']:.2f}, "
              f"requests/s x{r['requests_per_s']:.2f}, total tok/s x{r['total_tokens_per_s']:.2f}"
              f"{cpu}")
    for pair, m in res["greedy_output_agreement"].items():
        print(f"greedy outputs identical {pair}: {m:.0%}")
    others = [f"{r['backend']} {max(r['other_cpu_s_all']):.2f}" for r in res["results"]
              if "other_cpu_s_all" in r]
    if others:
        print("CPU s other processes used during a run, at most (the machine's busy time less "
              "the backend's): " + ", ".join(others))
    for r in res["results"]:
        if "spec_num_draft_tokens" in r:  # a speculating engine: its fastest run's counts
            print(f"{r['backend']}: speculation accepted {r['spec_num_accepted_tokens']} of "
                  f"{r['spec_num_draft_tokens']} proposed tokens (rate "
                  f"{r['spec_acceptance_rate']:.2f}), {r['spec_mean_accepted_length']:.2f} "
                  f"tokens per verification")
    for r in res["results"]:
        if "grammar_mask_s" in r:
            print(f"{r['backend']}: grammar masks {r['grammar_mask_s']:.3f} s computed, "
                  f"{r['grammar_wait_s']:.3f} s of it waited for")
    paths = [write_json(output_json or output_dir / "throughput.json", res)]
    if make_plots:
        rows = res["results"]

        def draw(plt: Any) -> None:
            names = [r["backend"] for r in rows]
            vals = [r["output_tokens_per_s"] for r in rows]
            plt.bar(names, vals, color="tab:blue")
            for i, v in enumerate(vals):
                plt.text(i, v, f"{v:.0f}", ha="center", va="bottom")
            plt.ylabel("output tokens/s")
            w = res["workload"]
            plt.title(f"throughput, {w['kind']} workload, {w['num_requests']} requests")

        p = plot(output_dir / "throughput.png", draw)
        if p:
            paths.append(p)
    return paths
