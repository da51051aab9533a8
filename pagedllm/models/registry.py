"""HF ``architectures`` names -> model classes."""

from __future__ import annotations

from pagedllm.config_hf import SUPPORTED_ARCHITECTURES
from pagedllm.models.base import CausalLM
from pagedllm.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,  # + per-head q/k norms (ModelConfig.qk_norm)
}
assert tuple(MODEL_REGISTRY) == SUPPORTED_ARCHITECTURES, "config_hf and the registry disagree"


def get_model_class(architecture: str) -> type[CausalLM]:
    cls = MODEL_REGISTRY.get(architecture)
    if cls is None:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(MODEL_REGISTRY)}"
        )
    return cls
