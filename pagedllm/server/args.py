"""ServerArgs: the settings of ``pagedllm serve`` that are not engine settings, once each.

Built like ``pagedllm.EngineArgs`` (``pagedllm.flags``): the fields make the flags, the YAML
``--config`` keys, and the defaults of ``ServerLimits``. Importing this module is cheap.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pagedllm.choices import TOOL_CALL_PARSERS
from pagedllm.flags import add_flags, from_namespace, setting

S = "server"


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
    max_logprobs: int = setting(
        20, "largest logprobs / top_logprobs / prompt_logprobs per request (the engine's cap is "
        "20)", group=S)
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

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        add_flags(parser, ServerArgs, {S: "server"})

    @classmethod
    def from_cli(cls, ns: argparse.Namespace) -> ServerArgs:
        return from_namespace(cls, ns)
