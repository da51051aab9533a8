"""``pagedllm serve [MODEL] [--host] [--port] [--api-key] [--config FILE.yaml] [engine flags]``.

The YAML file holds flag names as keys (dashes or underscores); flags given on the command line
win over the file, the file wins over the defaults. fastapi/uvicorn are imported only when the
command runs.
"""

from __future__ import annotations

import argparse
import os
import signal
from collections.abc import Callable
from typing import Any

DEFAULT_HOST = "127.0.0.1"  # loopback unless told otherwise


def register(subparsers: Any, add_engine_args: Callable[[argparse.ArgumentParser], None],
             engine_kwargs: Callable[[argparse.Namespace], dict[str, Any]]) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (FastAPI + uvicorn)")
    p.add_argument("model_pos", nargs="?", default=None, metavar="MODEL",
                   help="HF checkpoint directory (overrides --model)")
    g = p.add_argument_group("server")
    g.add_argument("--host", default=DEFAULT_HOST, help="bind address (default: loopback only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $PAGEDLLM_API_KEY)")
    g.add_argument("--config", default=None, help="YAML file of flag values (CLI flags win)")
    g.add_argument("--served-model-name", default=None, help="model name in the API (default: the model path)")
    g.add_argument("--batch-wait-ms", type=float, default=0.0,
                   help="how long the engine loop may wait for more arrivals before a step")
    g.add_argument("--max-request-bytes", type=int, default=1 << 20)
    g.add_argument("--max-n", type=int, default=16, help="largest n per request")
    g.add_argument("--max-tokens-limit", type=int, default=None, help="largest max_tokens (default: max_model_len)")
    g.add_argument("--max-prompt-tokens", type=int, default=None, help="longest prompt (default: max_model_len - 1)")
    g.add_argument("--max-prompts", type=int, default=32, help="prompts in one /v1/completions batch")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for in-flight requests before aborting them")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_engine_args(p)
    p.set_defaults(func=lambda a: cmd_serve(a, p, engine_kwargs))


def apply_config_file(args: argparse.Namespace, parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Fill ``args`` from ``args.config`` where the command line left the default.

    Keys are flag names or destinations, with dashes or underscores (``max-num-seqs``,
    ``max_num_seqs``, ``no-enable-prefix-caching: true``, ``enable_prefix_caching: false``).
    """
    if not args.config:
        return args
    import yaml

    with open(args.config, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{args.config}: expected a mapping of flag names to values")
    by_dest: dict[str, argparse.Action] = {}
    by_flag: dict[str, argparse.Action] = {}
    for action in parser._actions:
        if action.dest in ("help", "config", "func"):
            continue
        by_dest[action.dest] = action
        for opt in action.option_strings:
            by_flag[opt.lstrip("-").replace("-", "_")] = action
    for key, value in data.items():
        norm = str(key).replace("-", "_")
        found = by_flag.get(norm) or by_dest.get(norm)
        if found is None:
            raise ValueError(f"{args.config}: unknown key {key!r}; use `pagedllm serve --help` flag names")
        action = found
        if getattr(args, action.dest) != action.default:
            continue  # given on the command line: the command line wins
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            if not isinstance(value, bool):
                raise ValueError(f"{args.config}: {key} must be true or false")
            # the flag's own name means "flag given"; the destination's name is the value itself
            if norm == action.dest and norm not in by_flag:
                setattr(args, action.dest, value)
            elif value:
                setattr(args, action.dest, action.const)
            continue
        if value is not None and action.type is not None and not isinstance(value, bool):
            try:
                value = action.type(value)  # type: ignore[misc,operator]
            except (TypeError, ValueError):
                raise ValueError(f"{args.config}: {key}={value!r} is not a valid value") from None
        if action.choices is not None and value not in action.choices:
            raise ValueError(f"{args.config}: {key}={value!r}; choose one of {list(action.choices)}")
        setattr(args, action.dest, value)
    return args


def cmd_serve(args: argparse.Namespace, parser: argparse.ArgumentParser,
              engine_kwargs: Callable[[argparse.Namespace], dict[str, Any]]) -> int:
    import uvicorn

    from pagedllm.engine import LLMEngine
    from pagedllm.server.api import ServerLimits, build_app

    args = apply_config_file(args, parser)
    if args.model_pos is not None:
        args.model = args.model_pos
    api_key = args.api_key or os.environ.get("PAGEDLLM_API_KEY") or None
    limits = ServerLimits(
        max_request_bytes=args.max_request_bytes,
        max_n=args.max_n,
        max_tokens=args.max_tokens_limit,
        max_prompt_tokens=args.max_prompt_tokens,
        max_prompts=args.max_prompts,
    )
    engine = LLMEngine.from_args(**engine_kwargs(args))
    app = build_app(engine, model_name=args.served_model_name, api_key=api_key, limits=limits,
                    batch_wait_ms=args.batch_wait_ms)
    if args.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        print(f"warning: serving on {args.host} without --api-key", flush=True)
    # uvicorn handles SIGTERM/SIGINT: stop accepting, let in-flight requests finish for up to
    # --drain-timeout, then the app's lifespan aborts what is left and stops the engine. uvicorn
    # re-raises the signal afterwards to the handler it found; a no-op one makes the drain exit 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=args.drain_timeout)
    return 0
