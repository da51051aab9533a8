"""The ``pagedllm`` logger: INFO to stderr by default, like vLLM; PAGEDLLM_LOG_LEVEL overrides."""

from __future__ import annotations

import logging

from pagedllm import envs

_ROOT = "pagedllm"


def _configure() -> None:
    root = logging.getLogger(_ROOT)
    if root.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel((envs.get("PAGEDLLM_LOG_LEVEL") or "info").upper())
    root.propagate = False


def init_logger(name: str) -> logging.Logger:
    _configure()
    return logging.getLogger(name if name.startswith(_ROOT) else f"{_ROOT}.{name}")
