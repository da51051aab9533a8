"""ServerArgs: the settings of ``pagedllm serve`` that are not engine settings, once each.

Built like ``pagedllm.EngineArgs`` (``pagedllm.flags``): the fields make the flags, the YAML
``--config`` keys, and the defaults of ``ServerLimits``. Importing this module is cheap.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

from pagedllm import envs
from pagedllm.choices import TOOL_CALL_PARSERS
from pagedllm.flags import add_flags, from_namespace, setting
from pagedllm.router.policy import IMBALANCE_THRESHOLD, ROUTING_POLICIES

S = "server"
DP = "data parallel"
STATS_INTERVAL_S = 10.0  # the periodic stats line (server.stats_log), as vLLM's


def stats_interval() -> float:
    """Seconds between two stats lines: $PAGEDLLM_LOG_STATS_INTERVAL (vLLM:
    VLLM_LOG_STATS_INTERVAL), default ``STATS_INTERVAL_S``."""
    value = envs.get("PAGEDLLM_LOG_STATS_INTERVAL")
    try:
        interval = STATS_INTERVAL_S if value is None else float(value)
    except ValueError:
        interval = -1.0
    if not interval > 0:
        raise ValueError(f"PAGEDLLM_LOG_STATS_INTERVAL={value!r}: give a number of seconds > 0")
    return interval


@dataclass
class ServerArgs:
    host: str = setting("127.0.0.1", "bind address (default: loopback only)", group=S)
    port: int = setting(8000, "TCP port; 0 picks a free one (the 'listening on' line says which)",
                        group=S)
    api_key: str | None = setting(
        None, "require 'Authorization: Bearer KEY' on /v1/* (default: $PAGEDLLM_API_KEY)", group=S)
    served_model_name: str | None = setting(
        None, "model name in the API (default: the model path as given; default_model for the "
        "shipped model)", group=S)
    batch_wait_ms: float = setting(
        0.0, "how long the engine loop may wait for more arrivals before a step", group=S)
    burst_gap_ms: float = setting(
        0.0, "after an idle spell, requests arriving less than this apart join the "
        "first step (at most 50 ms in all; default 0: step at the first arrival)", group=S)
    engine_in_process: bool = setting(
        False, "run the engine core as a thread of the server process instead of in its own "
        "process (the model's steps then share the GIL with HTTP; for debugging)", group=S)
    max_request_bytes: int = setting(1 << 20, "largest request body", group=S)
    max_n: int = setting(16, "largest n per request", group=S)
    max_tokens_limit: int | None = setting(
        None, "largest max_tokens (default: max_model_len)", group=S)
    max_prompt_tokens: int | None = setting(
        None, "longest prompt (default: max_model_len - 1)", group=S)
    max_prompts: int = setting(32, "prompts in one /v1/completions batch", group=S)
    drain_timeout: float = setting(
        30.0, "seconds SIGTERM waits for in-flight requests; then they end with a 503 (streams: an "
        "error event and [DONE])", group=S)
    disable_fastapi_docs: bool = setting(
        False, "do not serve /docs, /redoc, /openapi.json (with --api-key they need the key)", group=S)
    kv_inspector: bool = setting(
        False, "serve the live KV cache page at /kv (data at /kv/state and /kv/stream, behind "
        "--api-key)", group=S)
    kv_inspector_show_text: bool = setting(
        False, "let the /kv page show prompt and output text", group=S)
    tool_call_parser: str | None = setting(
        None, "read tool calls out of the text for tool_choice 'auto': hermes "
        "(<tool_call>{json}</tool_call>) or llama3_json", group=S,
        choices=TOOL_CALL_PARSERS)
    chat_template: str | None = setting(
        None, "a Jinja chat template, FILE or the template text, instead of the tokenizer's",
        group=S)
    enable_log_requests: bool = setting(
        False, "log each request's id, endpoint and sampling parameters", group=S)
    log_level: str = setting("info", "uvicorn log level", "--uvicorn-log-level", group=S,
                             choices=("critical", "error", "warning", "info", "debug", "trace"))
    allowed_origins: str | None = setting(
        None, "CORS: the origins a browser page may call the API from, comma-separated or a JSON "
        "list ('*': any); default: no CORS headers", group=S)
    root_path: str = setting(
        "", "the path prefix a proxy serves the app under (ASGI root_path), e.g. /llm", group=S)
    ssl_keyfile: str | None = setting(
        None, "TLS: the server's private key (PEM); with --ssl-certfile, serve HTTPS", group=S,
        metavar="FILE")
    ssl_certfile: str | None = setting(
        None, "TLS: the server's certificate chain (PEM); serve HTTPS", group=S, metavar="FILE")
    ssl_ca_certs: str | None = setting(
        None, "TLS: CA certificates that client certificates are checked against", group=S,
        metavar="FILE")
    ssl_cert_reqs: int = setting(
        0, "TLS: whether clients must present a certificate (Python's ssl.CERT_*): 0 no, "
        "1 optional, 2 required", group=S, choices=(0, 1, 2))
    lora_modules: str | None = setting(
        None, "LoRA adapters served from the start (needs --enable-lora): NAME=PATH ..., each "
        "selected by the request's model: NAME", group=S, metavar="NAME=PATH")
    allow_runtime_lora_updating: bool = setting(
        False, "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind --api-key; "
        "also $PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING=1)",
        group=S)
    disable_log_stats: bool = setting(
        False, "do not log throughput, running/waiting requests and KV cache usage every "
        f"{STATS_INTERVAL_S:g} s", group=S)

    data_parallel_size: int = setting(
        1, "engine-core replicas behind this server, each a whole copy of the model; each "
        "request goes to one (--routing-policy)", "-dp", group=DP)
    data_parallel_backend: str = setting(
        "mp", "where replicas run: mp = processes on this machine, ray = Ray actors placed by Ray "
        "on the cluster of RAY_ADDRESS (else a local Ray instance)", group=DP, choices=("mp", "ray"))
    routing_policy: str = setting(
        "cache_aware", "which replica serves a request: cache_aware = the longest cached prefix "
        "(exact, from the replicas' KV events) unless the load is out of balance, least_load, "
        "round_robin", group=DP, choices=ROUTING_POLICIES)
    routing_imbalance_threshold: int = setting(
        IMBALANCE_THRESHOLD, "cache_aware: when the replicas' request counts differ by more, "
        "route to the least loaded whatever it has cached", group=DP)
    prefill_replicas: int = setting(
        0, "prefill/decode split: the first K replicas only prefill (a request's prompt, its KV "
        "put in the --kv-transfer-config tier), the others load it and decode (0: every replica "
        "does both)", group=DP, metavar="K")
    prefill_threads: int | None = setting(
        None, "torch threads of the engine core for steps of more than 256 tokens (prefill), "
        "e.g. every core while decode steps leave one to the API process (default: the same "
        "as the other steps; one engine core only)", group=DP)
    data_parallel_threads: int | None = setting(
        None, "torch threads per engine core (default: this machine's cores less one, left to "
        "the API process as vLLM leaves one, / --data-parallel-size, at least 1; with "
        "OMP_NUM_THREADS set, that; with ray also the CPUs each actor reserves)", group=DP)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        add_flags(parser, ServerArgs, {S: "server", DP: "data parallelism (names follow vLLM)"})

    @classmethod
    def from_cli(cls, ns: argparse.Namespace) -> ServerArgs:
        return from_namespace(cls, ns)

    def ssl_config(self) -> dict[str, Any]:
        """uvicorn's TLS keywords ({} without --ssl-certfile). ValueError naming the flag for a
        key without a certificate or a file that is not there."""
        if self.ssl_certfile is None:
            for flag, value in (("--ssl-keyfile", self.ssl_keyfile),
                                ("--ssl-ca-certs", self.ssl_ca_certs)):
                if value is not None:
                    raise ValueError(f"{flag} needs --ssl-certfile (the server's certificate)")
            return {}
        for flag, value in (("--ssl-certfile", self.ssl_certfile),
                            ("--ssl-keyfile", self.ssl_keyfile),
                            ("--ssl-ca-certs", self.ssl_ca_certs)):
            if value is not None and not os.path.isfile(value):
                raise ValueError(f"{flag} {value!r} is not a file")
        return {"ssl_certfile": self.ssl_certfile, "ssl_keyfile": self.ssl_keyfile,
                "ssl_ca_certs": self.ssl_ca_certs, "ssl_cert_reqs": self.ssl_cert_reqs}
