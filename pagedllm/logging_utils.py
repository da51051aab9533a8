"""The ``pagedllm`` logger: INFO to stderr by default, like vLLM; PAGEDLLM_LOG_LEVEL overrides."""

from __future__ import annotations

import logging
import os

_ROOT = "pagedllm"


def _configure() -> None:
    root = logging.getLogger(_ROOT)
    if root.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(os.environ.get("PAGEDLLM_LOG_LEVEL", "INFO").upper())
    root.propagate = False


def init_logger(name: str) -> logging.Logger:
    _configure()
    return logging.getLogger(name if name.startswith(_ROOT) else f"{_ROOT}.{name}")
