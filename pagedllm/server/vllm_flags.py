"""``pagedllm serve`` takes a vLLM user's command line: vLLM flags that change nothing a client
sees here are accepted with a warning; flags that would change the model or its outputs in a
way pagedllm does not implement are refused, naming the flag (never silently ignored). The
table, and its reasons, are ``pagedllm.vllm_args.VLLM_SETTINGS``, shared with ``LLM(...)``."""

from __future__ import annotations

import argparse
import sys

from pagedllm.vllm_args import VLLM_SETTINGS, check, cpu_no_effect, flag, takes_value

FLAGS = [name for name, s in VLLM_SETTINGS.items() if s.cli]
# flag -> why it has no effect here (store_true flags)
HARMLESS = {flag(n): VLLM_SETTINGS[n].why for n in FLAGS
            if not VLLM_SETTINGS[n].refused and not takes_value(n)}


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("vLLM flags (accepted with a warning, or refused naming why)")
    for name in FLAGS:
        if takes_value(name):
            g.add_argument(flag(name), dest=_dest(name), default=None, help=argparse.SUPPRESS)
        else:
            g.add_argument(flag(name), dest=_dest(name), action="store_true",
                           help=argparse.SUPPRESS)


def check_vllm_flags(args: argparse.Namespace) -> None:
    """Warn about the harmless vLLM flags given; ValueError naming a refused one."""
    warnings = [check(name, getattr(args, _dest(name), None), flag(name), "pagedllm serve")
                for name in FLAGS]
    warnings += cpu_no_effect(args.device, args.gpu_memory_utilization, args.enforce_eager)
    for line in warnings:
        if line is not None:
            print(f"warning: {line}", file=sys.stderr, flush=True)


def _dest(name: str) -> str:
    return "vllm_" + name
