"""What every ``pagedllm bench <sub>`` module shares: the output flags, the engine settings and the
workload of a parsed command line, printing what was written.

A subcommand module owns ``COMMAND`` (its name), ``HELP``, ``add_cli_args(parser)`` and
``run(args) -> int``; ``bench/cli.py`` registers each in a loop. Engine flags come from
``EngineArgs.add_cli_args`` only, workload flags from ``WorkloadSpec.add_cli_args``. Importing
this module is cheap (no torch): the CLI imports every subcommand module to build its parser.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from pagedllm.args import EngineArgs


def add_output_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--output-dir", type=Path, default=Path("bench-results"),
                   help="where JSON and PNG files go (default: ./bench-results)")
    g.add_argument("--output-json", type=Path, default=None,
                   help="JSON file (default: <output-dir>/<benchmark>.json)")
    g.add_argument("--no-plot", dest="plot", action="store_false", help="skip PNG plots")
    g.add_argument("--threads", type=int, default=None, help="torch intra-op threads")


def int_list(s: str) -> tuple[int, ...]:
    """``--block-sizes 1,4,64`` -> (1, 4, 64)."""
    try:
        return tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from e


def prepare(a: argparse.Namespace) -> None:
    """``--threads`` applied, ``--output-dir`` made."""
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    a.output_dir.mkdir(parents=True, exist_ok=True)


def engine_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    """The engine settings of the command line, as keyword arguments."""
    return dataclasses.asdict(EngineArgs.from_cli(a))


def add_workload_command_args(p: argparse.ArgumentParser, num_prompts: int,
                              arrivals: bool = False) -> None:
    """The flags of a benchmark that runs an engine over a workload: the workload's
    (``WorkloadSpec.add_cli_args``), the output's and the engine's."""
    from pagedllm.bench.workload import WorkloadSpec

    WorkloadSpec.add_cli_args(p, num_prompts, arrivals)
    add_output_args(p)
    EngineArgs.add_cli_args(p)


def workload(a: argparse.Namespace) -> tuple[dict[str, Any], Any, list[Any], Any]:
    """``prepare(a)``, then (engine kwargs, WorkloadSpec, requests, engine config) of the flags
    ``add_workload_command_args`` made."""
    from pagedllm.bench.workload import WorkloadSpec, build_workload

    prepare(a)
    kw = engine_kwargs(a)
    spec, reqs, cfg = build_workload(kw, WorkloadSpec.cli_kwargs(a))
    return kw, spec, reqs, cfg


def show(paths: list[Path]) -> int:
    for p in paths:
        print(f"wrote {p}")
    return 0
