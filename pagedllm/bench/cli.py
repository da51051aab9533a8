"""``pagedllm bench <sub>``: one subcommand per module (vLLM's benchmarks pattern).

Each module in ``SUBCOMMANDS`` owns ``COMMAND``, ``HELP`` (and optionally ``DESCRIPTION``),
``add_cli_args(parser)`` and ``run(args) -> int``; what they share is ``bench.command``.
Registered by ``pagedllm.entrypoints.cli``; the modules import torch and the engine inside
``run``, so building the parser stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

SUBCOMMANDS = ("throughput", "prefix", "latency", "memory", "block_size", "linear", "kernel",
               "serve", "random_model", "soak", "quant_eval", "tp")


def register(subparsers: Any) -> None:
    bench = subparsers.add_parser(
        "bench", help="benchmarks: throughput, memory, block size, kernel, serving")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    for name in SUBCOMMANDS:
        mod = importlib.import_module(f"pagedllm.bench.{name}")
        p = sub.add_parser(mod.COMMAND, help=mod.HELP,
                           description=getattr(mod, "DESCRIPTION", None))
        mod.add_cli_args(p)
        p.set_defaults(func=mod.run)
