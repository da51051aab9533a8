"""The KV tensors: one allocation for all layers.

    storage[2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]
             K/V

Layer l's caches are views ``storage[0, l]`` and ``storage[1, l]``, each
``[num_blocks, block_size, num_kv_heads, head_dim]`` as the attention backends expect.
The storage is zero-initialised so that never-written slots hold finite values.
"""

from __future__ import annotations

import torch

from pagedllm.config import ModelConfig

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def kv_bytes_per_block(model: ModelConfig, block_size: int) -> int:
    return model.kv_bytes_per_token * block_size


class KVCache:
    def __init__(
        self, model: ModelConfig, num_blocks: int, block_size: int, device: str = "cpu"
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.storage = torch.zeros(
            2,
            model.num_hidden_layers,
            num_blocks,
            block_size,
            model.num_key_value_heads,
            model.head_dim,
            dtype=torch_dtype(model.dtype),
            device=device,
        )
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (self.storage[0, i], self.storage[1, i]) for i in range(model.num_hidden_layers)
        ]

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()
