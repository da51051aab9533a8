"""``pagedllm generate | plan | serve | bench`` — the command line."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from pagedllm.config import default_model_path


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine (names follow vLLM)")
    g.add_argument("--model", default=None, help="HF checkpoint directory (default: the shipped model)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (power of two, 1..512)")
    g.add_argument("--kv-cache-memory", default=None, help="KV pool budget, e.g. 2GiB (default: fits --max-num-seqs full requests, <= 4GiB)")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="exact number of KV blocks (overrides --kv-cache-memory)")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    m = p.add_argument_group("KV memory management")
    m.add_argument("--swap-space", type=float, default=0, help="GiB of host memory for swapped-out KV blocks")
    m.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap", "auto"])
    m.add_argument("--reserved-fraction", type=float, default=0.1, help="share of blocks only the urgent class may take")
    m.add_argument("--urgent-priority", type=int, default=0, help="priority <= this is the urgent class")
    m.add_argument("--contiguous-urgent", action="store_true", help="give the urgent class runs of consecutive KV block ids where possible")
    m.add_argument("--initial-num-kv-blocks", type=int, default=None, help="start the pool smaller and grow it (elastic pool)")
    m.add_argument("--compact-every-n-steps", type=int, default=None, help="defragment every N steps")
    m.add_argument("--compact-below-utilization", type=float, default=None, help="defragment when utilization stays below this")
    m.add_argument("--kv-trace", dest="kv_trace_path", default=None, help="write the KV allocation event trace (JSONL, replayable) to this file")
    m.add_argument("--preheat-prompts", default=None, help="file of prompts (one per line, text or a JSON list of ids) to cache at start-up")
    g.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (default: cpu)")
    g.add_argument("--attention-backend", default=None,
                   help="torch_ref | cpu | triton (default: cpu on CPU, triton on CUDA)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="CUDA: fraction of GPU memory for weights + activations + KV pool, "
                        "when --kv-cache-memory / --num-kv-blocks are not given (default 0.9)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: no CUDA graphs; every step runs eagerly")
    kv_help = "auto (model dtype) | int8 | fp8 (= fp8_e4m3) | fp8_e4m3 | fp8_e5m2"
    g.add_argument("--kv-cache-dtype", default="auto", help=f"KV cache storage: {kv_help}")
    g.add_argument("--k-cache-dtype", default=None, help="override --kv-cache-dtype for K")
    g.add_argument("--v-cache-dtype", default=None, help="override --kv-cache-dtype for V")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="shard the model over N ranks (worker processes; CPU/gloo)")
    g.add_argument("--distributed-executor-backend", default=None, choices=["mp", "ray"],
                   help="where ranks 1..N-1 run: mp = local worker processes (default), ray = Ray actors")


def _engine_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    return dict(
        model=a.model,
        tokenizer=a.tokenizer,
        dtype=a.dtype,
        block_size=a.block_size,
        kv_cache_memory=a.kv_cache_memory,
        num_kv_blocks=a.num_kv_blocks,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_model_len=a.max_model_len,
        enable_prefix_caching=a.enable_prefix_caching,
        swap_space=a.swap_space,
        preemption_mode=a.preemption_mode,
        reserved_fraction=a.reserved_fraction,
        urgent_priority=a.urgent_priority,
        contiguous_urgent=a.contiguous_urgent,
        initial_num_kv_blocks=a.initial_num_kv_blocks,
        compact_every_n_steps=a.compact_every_n_steps,
        compact_below_utilization=a.compact_below_utilization,
        preheat_prompts=a.preheat_prompts,
        kv_trace_path=a.kv_trace_path,
        attention_backend=a.attention_backend,
        device=a.device,
        gpu_memory_utilization=a.gpu_memory_utilization,
        enforce_eager=a.enforce_eager,
        seed=a.seed,
        kv_cache_dtype=a.kv_cache_dtype,
        k_cache_dtype=a.k_cache_dtype,
        v_cache_dtype=a.v_cache_dtype,
        tensor_parallel_size=a.tensor_parallel_size,
        distributed_executor_backend=a.distributed_executor_backend,
    )


def cmd_generate(a: argparse.Namespace) -> int:
    from pagedllm.engine import LLMEngine
    from pagedllm.sampling_params import SamplingParams

    params = SamplingParams(
        n=1,
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        min_p=a.min_p,
        seed=a.sampling_seed,
        max_tokens=a.max_tokens,
        stop=a.stop or [],
        ignore_eos=a.ignore_eos,
    )
    engine = LLMEngine.from_args(**_engine_kwargs(a))
    out = sys.stdout
    for i, prompt in enumerate(a.prompt):
        rid = f"cli-{i}"
        engine.add_request(rid, prompt, params)
        out.write(prompt)
        out.flush()
        t0 = time.perf_counter()
        n_tokens, reason, shown = 0, None, 0
        while engine.has_unfinished_requests():
            for o in engine.step():
                text = o.outputs[0].text  # cumulative; held back while it may begin a stop string
                out.write(text[shown:])
                out.flush()
                shown = len(text)
                if o.finished:
                    n_tokens = len(o.outputs[0].token_ids)
                    reason = o.outputs[0].finish_reason
        dt = time.perf_counter() - t0
        out.write("\n")
        print(
            f"[{n_tokens} tokens in {dt:.2f}s, {n_tokens / max(dt, 1e-9):.1f} tok/s, finish_reason={reason}]",
            file=sys.stderr,
        )
    return 0


def cmd_plan(a: argparse.Namespace) -> int:
    from pagedllm.engine import build_engine_config
    from pagedllm.kv.plan import plan_kv_pool

    kwargs = _engine_kwargs(a)
    kwargs.pop("preheat_prompts")
    cfg = build_engine_config(**kwargs)
    plan = plan_kv_pool(cfg.model, cfg.cache, cfg.scheduler)
    m = cfg.model
    print(f"model            {m.model} ({m.architecture}, {m.num_hidden_layers} layers, "
          f"{m.num_attention_heads} q heads / {m.num_key_value_heads} kv heads, head_dim {m.head_dim}, {m.dtype})")
    c = cfg.cache
    print(f"KV per token     {c.kv_bytes_per_token(m)} bytes ({c.kv_dtype_label(m)}; "
          f"{m.kv_bytes_per_token} at {m.dtype})")
    print(f"block            {plan.block_size} tokens = {plan.bytes_per_block} bytes")
    print(f"pool             {plan.num_blocks} blocks = {plan.num_tokens} tokens = {plan.nbytes / 2**20:.1f} MiB")
    print(f"max_model_len    {plan.max_model_len} -> {plan.max_concurrent_full_requests} full-length requests fit at once")
    if cfg.is_cuda and c.kv_cache_memory is None and c.num_kv_blocks is None:
        print(f"note             on {cfg.device} the engine sizes the pool at start-up from "
              f"--gpu-memory-utilization={cfg.gpu_memory_utilization} and a memory profile; "
              f"the figures above use the CPU default budget; pass --kv-cache-memory to plan "
              f"a GPU pool")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="LLM inference on a paged KV cache")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one or more prompts, streamed to stdout")
    g.add_argument("prompt", nargs="+", help="prompt text (several prompts run one after another)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    _add_engine_args(g)
    g.set_defaults(func=cmd_generate)

    pl = sub.add_parser("plan", help="size the KV pool for a model and budget without loading weights")
    _add_engine_args(pl)
    pl.set_defaults(func=cmd_plan)

    # Subcommands that live beside their feature (server, bench) register themselves; each
    # module exposes register(subparsers, add_engine_args, engine_kwargs) and imports heavy deps
    # lazily.
    from pagedllm.bench import cli as bench_cli
    from pagedllm.server import cli as server_cli

    for module in (server_cli, bench_cli):
        module.register(sub, _add_engine_args, _engine_kwargs)
    parser.epilog = f"default model: {default_model_path()}"
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
