"""``pagedllm generate | plan | serve | bench`` — the command line."""

from __future__ import annotations

import argparse
import sys
from functools import partial

from pagedllm.args import EngineArgs
from pagedllm.config import default_model_path
from pagedllm.flags import ArgParser


def cmd_generate(a: argparse.Namespace) -> int:
    from pagedllm.engine import LLMEngine
    from pagedllm.engine.drive import Submission, drive
    from pagedllm.outputs import CompletionOutput, RequestOutput
    from pagedllm.sampling_params import RequestOutputKind

    engine = LLMEngine.from_engine_args(EngineArgs.from_cli(a))
    # flags the user set win, then the model's generation_config.json, then greedy
    params = engine.generation_defaults.sampling_params(
        {"temperature": 0.0}, n=1, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
        min_p=a.min_p, seed=a.sampling_seed, max_tokens=a.max_tokens, stop=a.stop or [],
        ignore_eos=a.ignore_eos, output_kind=RequestOutputKind.DELTA)
    out = sys.stdout
    deltas: list[CompletionOutput] = []

    def stream(outs: list[RequestOutput]) -> None:
        for o in outs:
            delta = o.outputs[0]  # new text; held back while it may begin a stop string
            out.write(delta.text)
            out.flush()
            deltas.append(delta)

    for i, prompt in enumerate(a.prompt):
        out.write(prompt)
        out.flush()
        deltas.clear()
        add = partial(engine.add_request, prompt=prompt, params=params)
        dt = drive(engine, [Submission(f"cli-{i}", add)], on_step=stream).elapsed
        n_tokens = sum(len(d.token_ids) for d in deltas)
        reason = deltas[-1].finish_reason if deltas else None
        out.write("\n")
        print(
            f"[{n_tokens} tokens in {dt:.2f}s, {n_tokens / max(dt, 1e-9):.1f} tok/s, finish_reason={reason}]",
            file=sys.stderr,
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    from pagedllm import __version__

    parser = ArgParser(prog="pagedllm", description="LLM inference on a paged KV cache")
    parser.add_argument("--version", action="version", version=f"pagedllm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one or more prompts, streamed to stdout")
    g.add_argument("prompt", nargs="+", help="prompt text (several prompts run one after another)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy; default: the model's generation_config.json, else greedy")
    g.add_argument("--top-p", type=float, default=None, help="default: generation_config, else 1")
    g.add_argument("--top-k", type=int, default=None, help="default: generation_config, else 0")
    g.add_argument("--min-p", type=float, default=None, help="default: generation_config, else 0")
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    EngineArgs.add_cli_args(g)
    g.set_defaults(func=cmd_generate)

    # Subcommands that live beside their feature (planner, server, bench) register themselves;
    # each module exposes register(subparsers) and imports heavy deps lazily.
    from pagedllm.bench import cli as bench_cli
    from pagedllm.planner import cli as planner_cli
    from pagedllm.server import cli as server_cli

    for module in (planner_cli, server_cli, bench_cli):
        module.register(sub)
    parser.epilog = f"default model: {default_model_path()}"
    return parser


def main(argv: list[str] | None = None) -> int:
    try:  # parsing reads --config files, whose faults are ValueErrors too
        parser = build_parser()
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # the subcommand's usage names its own flags, not the top level's
            sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
            sub.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
        return int(args.func(args))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
