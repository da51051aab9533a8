"""Random LoRA adapters in PEFT's on-disk format (``adapter_config.json`` +
``adapter_model.safetensors``), for a base model's config: what ``pagedllm bench throughput
--lora-adapters N`` runs when no real adapters are at hand. No PEFT needed."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pagedllm.config import ModelConfig
from pagedllm.lora.adapter import SUPPORTED


def write_random_adapter(model: ModelConfig, path: Path, rank: int, seed: int,
                         b_std: float = 0.02) -> Path:
    """A rank-``rank`` adapter on every projection of every layer, seeded; PEFT's scaling
    ``lora_alpha / r`` = 2. B is small (``b_std``), so the outputs stay those of a sane model."""
    shapes = model.projection_shapes  # (in, out)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model.num_hidden_layers):
        for proj, (n_in, n_out) in shapes.items():
            group = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{group}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) / n_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * b_std
    path.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(SUPPORTED),
        "bias": "none"}))
    return path


__all__ = ["write_random_adapter"]
