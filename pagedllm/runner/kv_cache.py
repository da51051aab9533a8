"""The KV tensors: one allocation for all layers.

    storage[2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]
             K/V

Layer l's caches are views ``storage[0, l]`` and ``storage[1, l]``, each
``[num_blocks, block_size, num_kv_heads, head_dim]`` as the attention backends expect.
The storage is zero-initialised so that never-written slots hold finite values.

Block moves (copy-on-write copies, swap out/in, compaction) are batched: a list of (src, dst)
pairs becomes one gather and one scatter over the whole ``[2, num_layers]`` stack, never one
tensor copy per block. The gather completes before the scatter, so a batch may read a block that
another pair of the same batch overwrites.

The host tier (``num_host_blocks`` > 0) has the same layout on the CPU, pinned when CUDA is used.
"""

from __future__ import annotations

import torch

from pagedllm.config import ModelConfig

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def kv_bytes_per_block(model: ModelConfig, block_size: int) -> int:
    return model.kv_bytes_per_token * block_size


def _index(ids: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long, device=device)


class KVCache:
    def __init__(
        self, model: ModelConfig, num_blocks: int, block_size: int, device: str = "cpu",
        num_host_blocks: int = 0,
    ) -> None:
        self.block_size = block_size
        self.device = torch.device(device)
        self._shape = (model.num_key_value_heads, model.head_dim)
        self._layers = model.num_hidden_layers
        self._dtype = torch_dtype(model.dtype)
        self.storage = self._alloc(num_blocks, self.device)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._make_views()
        self.host: torch.Tensor | None = None
        if num_host_blocks > 0:
            pin = self.device.type == "cuda"
            self.host = self._alloc(num_host_blocks, torch.device("cpu"), pin)

    def _alloc(self, num_blocks: int, device: torch.device, pin: bool = False) -> torch.Tensor:
        # [2, L, num_blocks, block_size, Hkv, D]
        return torch.zeros(2, self._layers, num_blocks, self.block_size, *self._shape,
                           dtype=self._dtype, device=device, pin_memory=pin)

    def _make_views(self) -> None:
        self.layers[:] = [(self.storage[0, i], self.storage[1, i]) for i in range(self._layers)]

    @property
    def num_blocks(self) -> int:
        return self.storage.shape[2]

    # -- batched block moves ------------------------------------------------------------------
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Device -> device: block dst := block src for every (src, dst)."""
        if pairs:
            src, dst = zip(*pairs)
            gathered = self.storage.index_select(2, _index(list(src), self.device))
            self.storage.index_copy_(2, _index(list(dst), self.device), gathered)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Device -> host for every (device block, host block)."""
        if pairs:
            assert self.host is not None, "swap_out without a host tier (swap_space=0)"
            dev, host = zip(*pairs)
            data = self.storage.index_select(2, _index(list(dev), self.device))
            self.host.index_copy_(2, _index(list(host), torch.device("cpu")), data.to("cpu"))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Host -> device for every (host block, device block)."""
        if pairs:
            assert self.host is not None, "swap_in without a host tier (swap_space=0)"
            host, dev = zip(*pairs)
            data = self.host.index_select(2, _index(list(host), torch.device("cpu")))
            data = data.to(self.device, non_blocking=self.host.is_pinned())
            self.storage.index_copy_(2, _index(list(dev), self.device), data)

    def resize(self, num_blocks: int) -> None:
        """Grow (new blocks zeroed) or shrink (drop the tail) the device pool; rebinds views."""
        old = self.storage
        if num_blocks == old.shape[2]:
            return
        new = self._alloc(num_blocks, self.device)
        keep = min(num_blocks, old.shape[2])
        new[:, :, :keep] = old[:, :, :keep]
        self.storage = new
        self._make_views()

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()
