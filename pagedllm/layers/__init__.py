"""Model building blocks: norms, rotary embeddings, activations, fused linears."""

from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.linear import MergedLinear
from pagedllm.layers.rmsnorm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding

__all__ = ["MergedLinear", "RMSNorm", "RotaryEmbedding", "SiluAndMul"]
