"""HF ``architectures`` names -> model classes."""

from __future__ import annotations

from pagedllm.models.base import CausalLM
from pagedllm.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def get_model_class(architecture: str) -> type[CausalLM]:
    cls = MODEL_REGISTRY.get(architecture)
    if cls is None:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(MODEL_REGISTRY)}"
        )
    return cls
