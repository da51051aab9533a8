"""``pagedllm serve [MODEL] [--host] [--port] [--api-key] [--config FILE.yaml] [engine flags]``.

The flags are the fields of ``ServerArgs`` and ``pagedllm.EngineArgs``. The YAML file holds flag
names as keys (dashes or underscores); flags given on the command line win over the file, the
file wins over the defaults (``pagedllm.flags``). fastapi/uvicorn are imported only when the
command runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import socket
from pathlib import Path
from typing import Any

from pagedllm import envs
from pagedllm._cpu import serving_threads
from pagedllm.args import EngineArgs
from pagedllm.config import EngineConfig
from pagedllm.flags import apply_config_file
from pagedllm.server.args import ServerArgs, stats_interval
from pagedllm.server.vllm_flags import add_vllm_flags, check_vllm_flags

__all__ = ["apply_config_file", "cmd_serve", "make_engine", "register"]


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (FastAPI + uvicorn)")
    p.add_argument("model_pos", nargs="?", default=None, metavar="MODEL",
                   help="HF checkpoint directory (overrides --model)")
    ServerArgs.add_cli_args(p)
    EngineArgs.add_cli_args(p)
    add_vllm_flags(p)
    for action in p._actions:  # --served-model-name A B ..., --lora-modules: several, as vLLM
        if action.dest in ("served_model_name", "lora_modules"):
            action.nargs = "+"
    p.set_defaults(func=cmd_serve)


def origins(value: str | None) -> list[str] | None:
    """--allowed-origins: a JSON list (vLLM's form) or comma-separated origins."""
    if value is None:
        return None
    if value.lstrip().startswith("["):
        parsed = json.loads(value)
        if not isinstance(parsed, list) or not all(isinstance(o, str) for o in parsed):
            raise ValueError(f"--allowed-origins {value!r}: give a JSON list of origin strings")
        return parsed
    return [o.strip() for o in value.split(",") if o.strip()]


def cmd_serve(args: argparse.Namespace) -> int:
    from pagedllm.engine.heap import freeze_startup_heap
    from pagedllm.server.api import ServerLimits, build_app
    from pagedllm.server.drain import DrainingServer
    from pagedllm.server.lora import parse_lora_modules

    check_vllm_flags(args)
    srv = ServerArgs.from_cli(args)
    allowed_origins = origins(srv.allowed_origins)  # a bad list fails before any process starts
    ssl = srv.ssl_config()  # so does a missing certificate
    lora_modules = parse_lora_modules(srv.lora_modules)  # a list (nargs="+") or a YAML string
    engine_args = EngineArgs.from_cli(args)
    if args.model_pos is not None:
        engine_args = dataclasses.replace(engine_args, model=args.model_pos)
    api_key = srv.api_key or envs.get("PAGEDLLM_API_KEY")
    # The engine core runs in its own process (started with the app, pagedllm/engine/core_proc.py),
    # or N of them (--data-parallel-size, pagedllm/router/client.py), unless --engine-in-process;
    # a bad setting fails here, before any process starts.
    config = engine_args.create_engine_config()
    engine = make_engine(srv, engine_args, config)
    name = srv.served_model_name
    if name is None and engine_args.model and not Path(engine_args.model).exists():
        name = engine_args.model  # a Hugging Face id: served by that name, not its cache path
    app = build_app(engine, model_name=name, api_key=api_key,
                    limits=ServerLimits.from_args(srv, config.max_logprobs), batch_wait_ms=srv.batch_wait_ms,
                    disable_docs=srv.disable_fastapi_docs, kv_inspector=srv.kv_inspector,
                    kv_inspector_show_text=srv.kv_inspector_show_text,
                    tool_call_parser=srv.tool_call_parser,
                    chat_template=srv.chat_template, log_requests=srv.enable_log_requests,
                    allowed_origins=allowed_origins,
                    log_stats_interval=None if srv.disable_log_stats else stats_interval(),
                    lora_modules=lora_modules,
                    allow_runtime_lora_updating=srv.allow_runtime_lora_updating
                    or envs.is_on("PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING"))
    if srv.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        print(f"warning: serving on {srv.host} without --api-key", flush=True)
    # SIGTERM/SIGINT: stop accepting, let in-flight requests finish for up to --drain-timeout,
    # then end the rest with a 503 (server/drain.py) and stop the engine (the core process
    # ignores both signals and stops when the server tells it to, or when the server is gone). uvicorn re-raises the
    # signal afterwards to the handler it found; a no-op one makes the drain exit 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    # Bind here, not in uvicorn, so that --port 0 can report the port the OS picked (no
    # pick-a-free-port-then-hand-it-over race for scripts and tests).
    sock = socket.socket(socket.AF_INET6 if ":" in srv.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((srv.host, srv.port))
    host = f"[{srv.host}]" if ":" in srv.host else srv.host
    scheme = "https" if ssl else "http"
    print(f"pagedllm serve: listening on {scheme}://{host}:{sock.getsockname()[1]}", flush=True)
    server = DrainingServer(app, srv.drain_timeout, log_level=srv.log_level, root_path=srv.root_path,
                            **ssl)
    freeze_startup_heap()  # the app, the tokenizer, the modules: never walked by a collection
    server.run(sockets=[sock])
    return 0 if server.started else 3  # uvicorn's STARTUP_FAILURE


def make_engine(srv: ServerArgs, engine_args: EngineArgs, config: EngineConfig) -> Any:
    """The engine the app serves: one core in its own process (``MPClient``), N replicas
    (``DPClient``: --data-parallel-size, or the ray backend), or an in-process engine."""
    from pagedllm.engine import LLMEngine
    from pagedllm.engine.client_mp import MPClient
    from pagedllm.router.client import DPClient

    dp = srv.data_parallel_size
    if srv.engine_in_process:
        if dp != 1:
            raise ValueError("--engine-in-process runs one engine; drop it or "
                             "--data-parallel-size")
        return LLMEngine.from_engine_args(engine_args)
    if dp == 1 and srv.data_parallel_backend == "mp" and not srv.prefill_replicas:
        return MPClient(engine_args, config, srv.batch_wait_ms,
                        srv.data_parallel_threads or serving_threads(),
                        burst_gap_ms=srv.burst_gap_ms, prefill_threads=srv.prefill_threads)
    return DPClient(engine_args, config, size=dp, backend=srv.data_parallel_backend,
                    policy=srv.routing_policy, batch_wait_ms=srv.batch_wait_ms,
                    num_threads=srv.data_parallel_threads,
                    imbalance_threshold=srv.routing_imbalance_threshold,
                    prefill_replicas=srv.prefill_replicas, burst_gap_ms=srv.burst_gap_ms)
