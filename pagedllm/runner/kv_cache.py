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

Quantized storage (``k_cache_dtype`` / ``v_cache_dtype`` not "auto", see attention/quant.py)
adds planes beside the K/V data; every plane has the block axis at dim 2, so every block move
moves a block's values and scales together::

    data    [2, L, num_blocks, block_size, Hkv, D]   K and V in one plane when they share a dtype,
    or      [1, L, ...] twice                         else a K plane and a V plane
    scales  [n, L, num_blocks, block_size, Hkv] bf16  n = how many of K, V are quantized (0: none)

A quantized layer cache is handed to the backends as ``QuantizedKV(data, scale)`` views.
"""

from __future__ import annotations

import math

import torch

from pagedllm.attention.base import to_device
from pagedllm.attention.quant import (
    QMAX,
    QUANT_DTYPES,
    SCALE_DTYPE,
    KVCacheTensor,
    QuantizedKV,
    raw,
)
from pagedllm.config import ModelConfig
from pagedllm.kv.ext_tier import payload_matches

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def storage_dtype(kv_cache_dtype: str, model_dtype: str) -> torch.dtype:
    """The tensor dtype K or V is stored in: the model dtype for "auto", else int8 / fp8."""
    return torch_dtype(model_dtype) if kv_cache_dtype == "auto" else QUANT_DTYPES[kv_cache_dtype]


class KVCache:
    def __init__(
        self, model: ModelConfig, num_blocks: int, block_size: int, device: str = "cpu",
        num_host_blocks: int = 0,
        k_cache_dtype: str = "auto",
        v_cache_dtype: str = "auto",
    ) -> None:
        self.block_size = block_size
        self.device = torch.device(device)
        self._layers = model.num_hidden_layers
        kd = storage_dtype(k_cache_dtype, model.dtype)
        vd = storage_dtype(v_cache_dtype, model.dtype)
        self._quant = (kd in QMAX, vd in QMAX)
        row = (model.num_key_value_heads, model.head_dim)
        # (planes along dim 0, row shape, dtype) of each plane; see the module docstring
        self._specs: list[tuple[int, tuple[int, ...], torch.dtype]] = (
            [(2, row, kd)] if kd == vd else [(1, row, kd), (1, row, vd)]
        )
        if any(self._quant):
            self._specs.append((sum(self._quant), row[:1], SCALE_DTYPE))
        self.planes = self._alloc(num_blocks, self.device)
        self.generation = 0  # bumped when the storage is reallocated (captured graphs go stale)
        self.layers: list[tuple[KVCacheTensor, KVCacheTensor]] = []
        self._make_views()
        self.host: list[torch.Tensor] | None = None
        if num_host_blocks > 0:
            pin = self.device.type == "cuda"
            self.host = self._alloc(num_host_blocks, torch.device("cpu"), pin)

    def _alloc(self, num_blocks: int, device: torch.device, pin: bool = False) -> list[torch.Tensor]:
        # each [n, L, num_blocks, block_size, *row]
        return [
            torch.zeros(n, self._layers, num_blocks, self.block_size, *row, dtype=dtype,
                        device=device, pin_memory=pin)
            for n, row, dtype in self._specs
        ]

    def _make_views(self) -> None:
        p = self.planes
        k_data, v_data = (p[0][0], p[0][1]) if p[0].shape[0] == 2 else (p[0][0], p[1][0])
        k_scale = p[-1][0] if self._quant[0] else None  # [L, nb, bs, Hkv]
        v_scale = p[-1][-1] if self._quant[1] else None

        def view(data: torch.Tensor, scale: torch.Tensor | None, i: int) -> KVCacheTensor:
            return data[i] if scale is None else QuantizedKV(data[i], scale[i])

        self.layers[:] = [
            (view(k_data, k_scale, i), view(v_data, v_scale, i)) for i in range(self._layers)
        ]

    @property
    def storage(self) -> torch.Tensor:
        """The K/V data plane [2, L, num_blocks, block_size, Hkv, D] (K's alone when K and V
        differ in dtype); the whole cache when K/V are stored at the model dtype."""
        return self.planes[0]

    @property
    def num_blocks(self) -> int:
        return self.planes[0].shape[2]

    # -- batched block moves ------------------------------------------------------------------
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Device -> device: block dst := block src for every (src, dst)."""
        if pairs:
            src, dst = zip(*pairs)
            src_i = to_device(src, torch.long, self.device)
            dst_i = to_device(dst, torch.long, self.device)
            for plane in map(raw, self.planes):
                plane.index_copy_(2, dst_i, plane.index_select(2, src_i))

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Device -> host for every (device block, host block)."""
        if pairs:
            assert self.host is not None, "swap_out without a host tier (swap_space=0)"
            dev, host = zip(*pairs)
            dev_i, host_i = to_device(dev, torch.long, self.device), torch.tensor(host, dtype=torch.long)
            for plane, host_plane in zip(self.planes, self.host, strict=True):
                data = raw(plane).index_select(2, dev_i).to("cpu")
                raw(host_plane).index_copy_(2, host_i, data)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Host -> device for every (host block, device block)."""
        if pairs:
            assert self.host is not None, "swap_in without a host tier (swap_space=0)"
            host, dev = zip(*pairs)
            dev_i, host_i = to_device(dev, torch.long, self.device), torch.tensor(host, dtype=torch.long)
            for plane, host_plane in zip(self.planes, self.host, strict=True):
                data = raw(host_plane).index_select(2, host_i)
                data = data.to(self.device, non_blocking=host_plane.is_pinned())
                raw(plane).index_copy_(2, dev_i, data)

    def export_blocks(self, blocks: list[int]) -> list[dict[str, torch.Tensor]]:
        """Each block's planes as a CPU payload {"p0": ..., "p1": ...} for the KV tier: data and
        (quantized) scales together, each ``[n, L, block_size, *row]``. One gather per plane."""
        if not blocks:
            return []
        idx = to_device(blocks, torch.long, self.device)
        planes = [raw(p).index_select(2, idx).to("cpu") for p in self.planes]
        return [{f"p{j}": pl[:, :, i].clone() for j, pl in enumerate(planes)}
                for i in range(len(blocks))]

    def payload_layout(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """What one block's payload holds: plane name -> (shape, dtype name)."""
        return {f"p{j}": (tuple(p.shape[:2] + p.shape[3:]), str(raw(p).dtype))
                for j, p in enumerate(self.planes)}

    def payload_fits(self, payload: dict[str, torch.Tensor]) -> bool:
        """Whether ``payload`` has this cache's planes, shapes and dtypes (else: recompute)."""
        return payload_matches(payload, self.payload_layout())

    def import_blocks(self, pairs: list[tuple[dict[str, torch.Tensor], int]]) -> None:
        """Write each (payload, device block); payloads must ``payload_fits``. One scatter per
        plane."""
        if pairs:
            payloads, dst = zip(*pairs)
            dst_i = to_device(dst, torch.long, self.device)
            for j, plane in enumerate(map(raw, self.planes)):
                data = torch.stack([q[f"p{j}"] for q in payloads], dim=2).to(self.device)
                plane.index_copy_(2, dst_i, data)

    # -- pages: a block's bytes in every layer, for LoRA adapters' weights (kv/adapters.py) -------
    @property
    def page_bytes(self) -> int:
        """Bytes one block holds in one layer, over every plane (data and scales)."""
        return sum(p.shape[0] * math.prod(p.shape[3:]) * raw(p).element_size() for p in self.planes)

    def _byte_planes(self) -> list[torch.Tensor]:
        return [raw(p).view(torch.uint8) for p in self.planes]  # [n, L, nb, bs, *row as bytes]

    def write_pages(self, blocks: list[int], data: torch.Tensor) -> None:
        """Write ``data`` (uint8 [L, len(blocks) * page_bytes]) into ``blocks``: layer l's bytes
        fill block after block, each block's planes of layer l in turn. One scatter per plane."""
        k = len(blocks)
        idx = to_device(blocks, torch.long, self.device)
        data = data.view(self._layers, k, self.page_bytes).to(self.device)
        off = 0
        for p in self._byte_planes():
            n, per = p.shape[0], math.prod(p.shape[3:])
            part = data[:, :, off:off + n * per].reshape(self._layers, k, n, *p.shape[3:])
            p.index_copy_(2, idx, part.movedim(2, 0).contiguous())
            off += n * per

    def read_pages(self, blocks: list[int]) -> torch.Tensor:
        """What ``write_pages`` wrote into ``blocks``: uint8 [L, len(blocks) * page_bytes]."""
        k = len(blocks)
        idx = to_device(blocks, torch.long, self.device)
        parts = [p.index_select(2, idx).movedim(0, 2).reshape(self._layers, k, -1)
                 for p in self._byte_planes()]
        return torch.cat(parts, dim=2).reshape(self._layers, -1)

    def resize(self, num_blocks: int) -> None:
        """Grow (new blocks zeroed) or shrink (drop the tail) the device pool; rebinds views."""
        old = self.planes
        if num_blocks == self.num_blocks:
            return
        new = self._alloc(num_blocks, self.device)
        keep = min(num_blocks, self.num_blocks)
        for new_plane, old_plane in zip(new, old, strict=True):
            new_plane[:, :, :keep] = old_plane[:, :, :keep]
        self.planes = new
        self.generation += 1
        self._make_views()

    @property
    def nbytes(self) -> int:
        return sum(plane.numel() * plane.element_size() for plane in self.planes)
