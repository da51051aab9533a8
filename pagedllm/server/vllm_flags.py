"""``pagedllm serve`` takes a vLLM user's command line: vLLM flags that change nothing a client
sees here are accepted with a warning; flags that would change the model or its outputs in a
way pagedllm does not implement are refused, naming the flag (never silently ignored)."""

from __future__ import annotations

import argparse
import sys

# flag -> why it has no effect here (store_true flags)
HARMLESS = {
    "--trust-remote-code": "pagedllm runs its own model code, never the checkpoint's",
    "--disable-log-requests": "requests are logged only with --enable-log-requests",
    "--enable-auto-tool-choice": "tool_choice 'auto' is on whenever --tool-call-parser is set",
    "--disable-frontend-multiprocessing": "the API server and the engine share one process",
    "--disable-uvicorn-access-log": "use --log-level warning",
}
# flag -> what to do instead (flags that take a value)
REFUSED = {
    "--quantization": "pagedllm loads unquantized weights only (KV cache: --kv-cache-dtype)",
    "--lora-modules": "the server does not load LoRA adapters yet; use LLM(enable_lora=True) "
                      "and generate(..., lora_request=...)",
    "--pipeline-parallel-size": "use --tensor-parallel-size",
    "--cpu-offload-gb": "weights stay on one device; use --swap-space for KV",
    "--load-format": "pagedllm reads safetensors checkpoints only",
    "--tokenizer-mode": "pagedllm uses the checkpoint's fast tokenizer",
}
_VALUED = frozenset({"--quantization", "--lora-modules",
                     "--pipeline-parallel-size", "--cpu-offload-gb", "--load-format",
                     "--tokenizer-mode"})


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("vLLM flags (accepted with a warning, or refused naming why)")
    for flag in HARMLESS:
        g.add_argument(flag, dest=_dest(flag), action="store_true", help=argparse.SUPPRESS)
    for flag in REFUSED:
        if flag in _VALUED:
            g.add_argument(flag, dest=_dest(flag), default=None, help=argparse.SUPPRESS)
        else:
            g.add_argument(flag, dest=_dest(flag), action="store_true", help=argparse.SUPPRESS)


def check_vllm_flags(args: argparse.Namespace) -> None:
    """Warn about the harmless vLLM flags given; ValueError naming a refused one."""
    for flag, why in REFUSED.items():
        value = getattr(args, _dest(flag), None)
        if value not in (None, False) and not (flag == "--pipeline-parallel-size" and value == "1"):
            raise ValueError(f"{flag} is not supported by pagedllm serve: {why}")
    for flag, why in HARMLESS.items():
        if getattr(args, _dest(flag), False):
            print(f"warning: {flag} has no effect here ({why})", file=sys.stderr, flush=True)


def _dest(flag: str) -> str:
    return "vllm_" + flag.lstrip("-").replace("-", "_")
