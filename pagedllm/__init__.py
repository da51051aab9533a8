"""pagedllm: an LLM inference engine built around a paged KV cache.

The public names are imported lazily so that the pure-Python parts (``pagedllm.kv``,
``pagedllm.sched``) can be used, tested and replayed without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedllm import _hugepages, _openmp  # noqa: F401 - before torch loads (see those modules)

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "StructuredOutputsParams", "RequestOutputKind", "RequestOutput", "CompletionOutput", "LoRARequest", "__version__"]

_LAZY = {
    "LLM": "pagedllm.entrypoints.llm",
    "LLMEngine": "pagedllm.engine.core",
    "EngineArgs": "pagedllm.args",
    "SamplingParams": "pagedllm.sampling_params",
    "StructuredOutputsParams": "pagedllm.sampling_params",
    "RequestOutputKind": "pagedllm.sampling_params",
    "RequestOutput": "pagedllm.outputs",
    "CompletionOutput": "pagedllm.outputs",
    "LoRARequest": "pagedllm.lora.request",
}

if TYPE_CHECKING:
    from pagedllm.args import EngineArgs
    from pagedllm.engine.core import LLMEngine
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.lora.request import LoRARequest
    from pagedllm.outputs import CompletionOutput, RequestOutput
    from pagedllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
