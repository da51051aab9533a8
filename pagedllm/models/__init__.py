"""Model definitions, the architecture registry and the safetensors loader."""

from pagedllm.models.base import CausalLM
from pagedllm.models.loader import load_model
from pagedllm.models.registry import MODEL_REGISTRY, get_model_class

__all__ = ["CausalLM", "MODEL_REGISTRY", "get_model_class", "load_model"]
