"""``pagedllm bench throughput | prefix | latency | memory | block-size | linear | kernel | serve | soak
| random-model``.

Registered by ``pagedllm.entrypoints.cli``; everything heavy is imported inside the command functions.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from pagedllm.args import EngineArgs
from pagedllm.bench.workload import WORKLOADS


def engine_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    """The engine settings of the command line, as keyword arguments."""
    return dataclasses.asdict(EngineArgs.from_cli(a))


def _ints(s: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from e


def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--output-dir", type=Path, default=Path("bench-results"),
                   help="where JSON and PNG files go (default: ./bench-results)")
    g.add_argument("--output-json", type=Path, default=None,
                   help="JSON file (default: <output-dir>/<benchmark>.json)")
    g.add_argument("--no-plot", dest="plot", action="store_false", help="skip PNG plots")
    g.add_argument("--threads", type=int, default=None, help="torch intra-op threads")


def _workload_args(p: argparse.ArgumentParser, num_prompts: int) -> None:
    g = p.add_argument_group("workload (seeded; see pagedllm.bench.workload)")
    g.add_argument("--workload", choices=list(WORKLOADS), default="longtail")
    g.add_argument("--num-prompts", type=int, default=num_prompts)
    g.add_argument("--trace", default=None, help="JSONL trace for --workload trace")
    g.add_argument("--prompt-median", type=float, default=96.0, help="longtail: median prompt length")
    g.add_argument("--prompt-sigma", type=float, default=0.8, help="longtail: log-normal sigma")
    g.add_argument("--output-median", type=float, default=64.0, help="longtail: median output length")
    g.add_argument("--output-sigma", type=float, default=0.9, help="longtail: log-normal sigma")
    g.add_argument("--input-len", type=int, default=128, help="fixed: prompt length")
    g.add_argument("--output-len", type=int, default=128, help="fixed / chat: output length")
    g.add_argument("--system-len", type=int, default=128,
                   help="chat / multi-tenant: shared system prompt length")
    g.add_argument("--turns", type=int, default=4, help="chat: turns per conversation")
    g.add_argument("--user-len", type=int, default=32,
                   help="chat: tokens per user/assistant message; multi-tenant: per question")
    g.add_argument("--num-tenants", type=int, default=8, help="multi-tenant: system prompts")
    g.add_argument("--users-per-tenant", type=int, default=None,
                   help="multi-tenant: requests per system prompt (default: --num-prompts spread "
                   "over the tenants)")


def _spec_kwargs(a: argparse.Namespace, seed: int) -> dict[str, Any]:
    return dict(kind=a.workload, num_prompts=a.num_prompts, seed=seed, trace=a.trace,
                prompt_median=a.prompt_median, prompt_sigma=a.prompt_sigma,
                output_median=a.output_median, output_sigma=a.output_sigma,
                input_len=a.input_len, output_len=a.output_len, system_len=a.system_len,
                turns=a.turns, user_len=a.user_len, num_tenants=a.num_tenants,
                users_per_tenant=a.users_per_tenant)


def _setup(a: argparse.Namespace) -> None:
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    a.output_dir.mkdir(parents=True, exist_ok=True)


def _show(paths: list[Path]) -> None:
    for p in paths:
        print(f"wrote {p}")


def register(subparsers: Any) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: throughput, memory, block size, kernel, serving")
    sub = bench.add_subparsers(dest="bench_command", required=True)

    # -- throughput ---------------------------------------------------------------------------
    p = sub.add_parser("throughput", help="offline throughput: pagedllm vs HF transformers vs "
                       "contiguous reservation (vs vLLM when installed), interleaved",
                       description="All backends run on --device at the dtype the engine "
                       "resolves from --dtype (auto = the checkpoint's); on a GPU pass "
                       "--device cuda --dtype bfloat16.")
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
    p.add_argument("--reps", type=int, default=3, help="repetitions per backend (the fastest is reported)")
    p.add_argument("--hf-batch-size", type=int, default=16, help="HF generate static batch size")
    p.add_argument("--warmup", type=int, default=4, help="requests in each backend's warm-up run")
    p.add_argument("--json-schema", default=None, metavar="FILE", help="backend pagedllm-json: "
                   "this schema on every request (default: records that run to max_tokens)")
    _workload_args(p, 64)
    _common(p)
    EngineArgs.add_cli_args(p)

    def cmd_throughput(a: argparse.Namespace) -> int:
        from pagedllm.bench.baselines import BACKENDS, parse_backend, split_backends
        from pagedllm.bench.throughput import report_throughput, run_throughput
        from pagedllm.bench.vllm_backend import find_vllm_python
        from pagedllm.bench.workload import build_workload

        _setup(a)
        if a.backends is None:
            a.backends = "pagedllm,hf,contiguous" + (",vllm" if find_vllm_python(a.vllm_python) else "")
        names = split_backends(a.backends)
        bad = [b for b in names if parse_backend(b)[0] not in BACKENDS]
        if bad or not names or len(set(names)) != len(names):
            raise ValueError(f"--backends {a.backends!r}: choose distinct names from {', '.join(BACKENDS)}")
        kw = engine_kwargs(a)
        spec, reqs, _ = build_workload(kw, _spec_kwargs(a, a.seed))
        schema = None if a.json_schema is None else json.loads(Path(a.json_schema).read_text())
        res = run_throughput(reqs, spec, kw, names, a.reps, a.hf_batch_size, a.warmup,
                             a.vllm_python, a.vllm_kwargs, schema)
        _show(report_throughput(res, a.output_dir, a.output_json, a.plot))
        return 0

    p.set_defaults(func=cmd_throughput)

    # -- prefix caching: TTFT on a shared-system-prompt workload ---------------------------------
    p = sub.add_parser("prefix", help="time to first token with prefix caching on vs off on a "
                       "shared-system-prompt (chat) workload, interleaved")
    p.add_argument("--reps", type=int, default=3, help="repetitions per setting (TTFT pooled, "
                   "fastest for throughput)")
    p.add_argument("--warmup", type=int, default=4, help="requests in each engine's warm-up run")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrivals, requests/s (default inf: all at t0)")
    _workload_args(p, 32)
    p.set_defaults(workload="chat")
    _common(p)
    EngineArgs.add_cli_args(p)

    def cmd_prefix(a: argparse.Namespace) -> int:
        from pagedllm.bench.prefix import report_prefix, run_prefix
        from pagedllm.bench.workload import build_workload

        _setup(a)
        kw = engine_kwargs(a)
        spec, reqs, _ = build_workload(kw, _spec_kwargs(a, a.seed))
        res = run_prefix(reqs, spec, kw, a.reps, a.request_rate, a.warmup, a.seed)
        _show(report_prefix(res, a.output_dir, a.output_json, a.plot))
        return 0

    p.set_defaults(func=cmd_prefix)

    # -- latency: single-request / small-batch decode, speculative decoding on vs off ----------
    p = sub.add_parser("latency", help="single-request and small-batch decode speed, "
                       "speculative decoding on vs off, interleaved")
    p.add_argument("--batch-sizes", type=_ints, default=(1, 4, 16))
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--reps", type=int, default=3, help="repetitions per engine (the fastest is reported)")
    p.add_argument("--random-prompts", action="store_true",
                   help="seeded random token ids instead of held-out code (nothing repeats)")
    _common(p)
    EngineArgs.add_cli_args(p)

    def cmd_latency(a: argparse.Namespace) -> int:
        from pagedllm.bench.latency import code_prompts, random_prompts, report_latency, run_latency
        from pagedllm.bench.workload import engine_config
        from pagedllm.tokenizer import get_tokenizer

        _setup(a)
        kw = engine_kwargs(a)
        cfg = engine_config(kw)
        n = max(a.batch_sizes)
        if a.random_prompts:
            prompts = random_prompts(cfg.model.vocab_size, n, a.prompt_len, a.seed)
        else:
            prompts = code_prompts(get_tokenizer(cfg.tokenizer), n, a.prompt_len)
        spec = cfg.speculative
        spec_dict = dataclasses.asdict(spec) if spec is not None else None
        res = run_latency(prompts, kw, spec_dict, tuple(a.batch_sizes), a.output_len, a.reps)
        _show(report_latency(res, a.output_dir, a.output_json, a.plot))
        return 0

    p.set_defaults(func=cmd_latency)

    # -- memory -------------------------------------------------------------------------------
    p = sub.add_parser("memory", help="paged vs contiguous at the same KV budget: concurrency and "
                       "KV utilization over time")
    p.add_argument("--mode", choices=["real", "replay"], default="real",
                   help="real engines (default) or a model-free scheduler replay")
    p.add_argument("--full-requests", type=int, default=8,
                   help="without --num-kv-blocks: size the pool for this many max_model_len requests")
    _workload_args(p, 64)
    _common(p)
    EngineArgs.add_cli_args(p)

    def cmd_memory(a: argparse.Namespace) -> int:
        from pagedllm.bench.memory import default_num_blocks, report_memory, run_memory
        from pagedllm.bench.workload import build_workload

        _setup(a)
        kw = engine_kwargs(a)
        spec, reqs, cfg = build_workload(kw, _spec_kwargs(a, a.seed))
        nb = a.num_kv_blocks or default_num_blocks(cfg.scheduler.max_model_len,
                                                   cfg.cache.block_size, a.full_requests)
        res = run_memory(reqs, spec, kw, nb, a.mode)
        _show(report_memory(res, a.output_dir, a.output_json, a.plot))
        return 0

    p.set_defaults(func=cmd_memory)

    # -- block size ---------------------------------------------------------------------------
    p = sub.add_parser("block-size", help="sweep KV block sizes at a fixed KV memory")
    p.add_argument("--block-sizes", type=_ints, default=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
    p.add_argument("--budget-tokens", type=int, default=None,
                   help="KV token slots for every block size (default: 16 x max_model_len)")
    p.add_argument("--reps", type=int, default=2, help="repetitions (the fastest is reported)")
    _workload_args(p, 32)
    _common(p)
    EngineArgs.add_cli_args(p)

    def cmd_block_size(a: argparse.Namespace) -> int:
        from pagedllm.bench.block_size import report_block_size, run_block_size
        from pagedllm.bench.workload import build_workload

        _setup(a)
        kw = engine_kwargs(a)
        spec, reqs, cfg = build_workload(kw, _spec_kwargs(a, a.seed))
        budget = a.budget_tokens or 16 * cfg.scheduler.max_model_len
        res = run_block_size(reqs, spec, kw, budget, tuple(a.block_sizes), a.reps)
        _show(report_block_size(res, a.output_dir, a.output_json, a.plot))
        return 0

    p.set_defaults(func=cmd_block_size)

    # -- linear layers ------------------------------------------------------------------------
    p = sub.add_parser("linear", help="time in the engine's linear layers vs the GEMM rate "
                       "oneDNN reaches alone on the same shapes")
    p.add_argument("--warmup", type=int, default=4, help="requests in the warm-up run")
    _workload_args(p, 16)
    _common(p)
    EngineArgs.add_cli_args(p)

    def cmd_linear(a: argparse.Namespace) -> int:
        from pagedllm.bench.linear import report_linear, run_linear
        from pagedllm.bench.workload import build_workload

        _setup(a)
        kw = engine_kwargs(a)
        spec, reqs, _ = build_workload(kw, _spec_kwargs(a, a.seed))
        _show(report_linear(run_linear(reqs, spec, kw, a.warmup), a.output_dir, a.output_json))
        return 0

    p.set_defaults(func=cmd_linear)

    # -- kernel -------------------------------------------------------------------------------
    p = sub.add_parser("kernel", help="paged attention vs contiguous SDPA, decode and prefill; "
                       "on CUDA also decode bandwidth vs the GPU's peak and prefill TFLOP/s")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (default: cpu)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="K/V/Q dtype (default: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--model", default=None,
                   help="take head shapes from this checkpoint (default: the shipped model on "
                   "CPU; 32 q / 8 kv heads, head_dim 128 on CUDA)")
    p.add_argument("--num-heads", type=int, default=None)
    p.add_argument("--num-kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--contexts", type=_ints, default=None,
                   help="default: 128,512,2048 on CPU; 1024,4096,16384,32768 on CUDA")
    p.add_argument("--block-sizes", type=_ints, default=None, help="default: 16,64,256")
    p.add_argument("--batch", type=int, default=None,
                   help="decode batch (default: 16 on CPU, 32 on CUDA; prefill uses 1 request)")
    p.add_argument("--phases", default="decode,prefill")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--attention-backend", "--backend", dest="attention_backend", default=None,
                   help="torch_ref | cpu | triton (default: cpu on CPU, triton on CUDA; triton "
                   "on CPU needs TRITON_INTERPRET=1 in the environment)")
    p.add_argument("--no-copy-bandwidth", dest="copy_bandwidth", action="store_false",
                   help="skip measuring the device copy bandwidth (the frac_copy reference)")
    p.add_argument("--seed", type=int, default=0)
    _common(p)

    def cmd_kernel(a: argparse.Namespace) -> int:
        from pagedllm.bench.kernel import kernel_defaults, run_kernel
        from pagedllm.bench.kernel_report import report_kernel

        _setup(a)
        d = kernel_defaults(a.device)
        heads = d["heads"] if d["heads"] and a.model is None else _model_heads(a.model)
        res = run_kernel(
            contexts=tuple(a.contexts or d["contexts"]),
            block_sizes=tuple(a.block_sizes or d["block_sizes"]), batch=a.batch or d["batch"],
            phases=tuple(x.strip() for x in a.phases.split(",") if x.strip()),
            num_heads=a.num_heads or heads[0], num_kv_heads=a.num_kv_heads or heads[1],
            head_dim=a.head_dim or heads[2], rounds=a.rounds, iters=a.iters,
            backend=a.attention_backend, seed=a.seed, device=a.device, dtype=a.dtype,
            measure_copy=a.copy_bandwidth,
        )
        _show(report_kernel(res, a.output_dir, a.output_json, a.plot))
        return 0

    p.set_defaults(func=cmd_kernel)

    # -- serve --------------------------------------------------------------------------------
    p = sub.add_parser("serve", help="online latency against a running `pagedllm serve` (HTTP)")
    from pagedllm.bench.serve import add_cli_args as add_serve_args

    add_serve_args(p)
    _workload_args(p, 64)
    _common(p)

    def cmd_serve(a: argparse.Namespace) -> int:
        from pagedllm.bench.serve import report_serve, run_serve, run_serve_backends
        from pagedllm.bench.workload import WorkloadSpec, make_workload, vocab_ids
        from pagedllm.config import ModelConfig, default_model_path
        from pagedllm.tokenizer import get_tokenizer

        _setup(a)
        model = a.model or default_model_path()
        mcfg = ModelConfig.from_hf(model)
        tok = get_tokenizer(a.tokenizer or model)
        spec = WorkloadSpec(max_model_len=a.max_model_len or mcfg.max_position_embeddings,
                            **_spec_kwargs(a, a.seed))
        reqs = make_workload(spec, vocab_ids(tok, min(len(tok), mcfg.vocab_size)), tok)
        if a.backends or a.policies or a.serve_args:
            _show(run_serve_backends(a, model, reqs, tok, spec.describe()))
            return 0
        res = run_serve(a.base_url, reqs, a.request_rate, a.max_concurrency, a.served_model_name,
                        a.slo_ttft_ms, a.slo_tpot_ms, a.slo_e2e_ms, a.prompt_format, a.seed,
                        a.timeout, tok, a.use_trace_arrivals)
        res["workload"] = {**spec.describe(), **res["workload"]}
        _show(report_serve(res, a.output_dir, a.output_json, a.plot))
        return 0

    p.set_defaults(func=cmd_serve)

    # -- a random-weight model of a realistic size ----------------------------------------------
    p = sub.add_parser("random-model", help="write a random-weight Llama checkpoint "
                       "(presets: 100m, 1b, tiny)")

    from pagedllm.bench import random_model

    random_model.add_args(p)
    p.set_defaults(func=random_model.run)

    # -- soak: hours of mixed, partly bad traffic against a real server ---------------------------
    p = sub.add_parser("soak", help="long mixed traffic (random sampling, n, stops, disconnects, "
                       "bad requests) against a `pagedllm serve` subprocess: 5xx, RSS, idle KV "
                       "blocks, p99 drift")
    from pagedllm.bench import soak

    soak.add_args(p)
    p.set_defaults(func=soak.run)

    # -- KV quantization accuracy / capacity (flags: `pagedllm bench kv-quant --help`) -------------
    p = sub.add_parser("kv-quant",
                       help="quantized KV (int8 / fp8, K and V separately) vs the unquantized cache: "
                       "top-1 agreement, perplexity, greedy agreement, bytes/token, capacity")
    from pagedllm.bench.quant_eval import add_args as add_quant_args

    add_quant_args(p)

    def cmd_kv_quant(a: argparse.Namespace) -> int:
        from pagedllm.bench.quant_eval import run

        return run(a)

    p.set_defaults(func=cmd_kv_quant)


def _model_heads(model: str | None) -> tuple[int, int, int]:
    """(q heads, kv heads, head_dim) of ``model``; (8, 2, 64) when no checkpoint is there."""
    from pagedllm.config import ModelConfig, default_model_path

    path = model or default_model_path()
    try:
        m = ModelConfig.from_hf(path)
    except ValueError:
        if model is not None:
            raise
        return 8, 2, 64
    return m.num_attention_heads, m.num_key_value_heads, m.head_dim
