"""An adapter's weights as pages of the KV pool: per layer, the bytes of its A and B matrices
laid end to end, written across its blocks (runner/kv_cache.py ``write_pages``)::

    layer l's bytes   [ A(q,k,v) | B(q) | B(k) | B(v) | A(o) | B(o) | A(gate,up) | ... | 0 pad ]
                       └ block 0, plane by plane ┘└ block 1 ...                                ┘

Every layer uses the same blocks (a block spans all layers), so an adapter takes
``ceil(its largest layer's bytes / page_bytes)`` blocks, ``page_bytes`` being one block's
bytes in one layer over every KV plane. ``PageLayout`` is where each matrix lies; it is kept
for every known adapter, so the weights read back from the pages need nothing else.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from pagedllm.lora.adapter import LoRAWeights, Target

_LAYER = re.compile(r"\.(\d+)\.")


def layer_of(module_name: str) -> int:
    """The decoder layer a module belongs to (``model.layers.3.mlp.down_proj`` -> 3)."""
    m = _LAYER.search(module_name)
    if m is None:
        raise ValueError(f"LoRA target {module_name!r} names no layer index")
    return int(m.group(1))


@dataclass(frozen=True)
class PageEntry:
    target: Target
    layer: int
    offset: int  # bytes into the layer's row
    a_shape: tuple[int, int]
    b_shape: tuple[int, int]


@dataclass(frozen=True)
class PageLayout:
    entries: tuple[PageEntry, ...]
    dtype: torch.dtype
    rank: int
    layer_bytes: int  # the largest layer's bytes

    def num_pages(self, page_bytes: int) -> int:
        return max(1, -(-self.layer_bytes // page_bytes))


def page_layout(w: LoRAWeights, dtype: torch.dtype) -> PageLayout:
    """Where ``w``'s matrices lie in its pages, stored at ``dtype`` (the compute slots')."""
    size = torch.empty((), dtype=dtype).element_size()
    used: dict[int, int] = {}
    entries = []
    for target in sorted(w.targets):
        layer = layer_of(target[0])
        a, b = w.targets[target]
        off = used.get(layer, 0)
        entries.append(PageEntry(target, layer, off, tuple(a.shape), tuple(b.shape)))  # type: ignore[arg-type]
        used[layer] = off + (a.numel() + b.numel()) * size
    return PageLayout(tuple(entries), dtype, w.rank, max(used.values(), default=0))


def pack(w: LoRAWeights, layout: PageLayout, num_layers: int, num_blocks: int,
         page_bytes: int) -> torch.Tensor:
    """The adapter's bytes as ``write_pages`` takes them: uint8 [num_layers, num_blocks * page_bytes]."""
    out = torch.zeros(num_layers, num_blocks * page_bytes, dtype=torch.uint8)
    for e in layout.entries:
        a, b = w.targets[e.target]
        flat = torch.cat([a.reshape(-1), b.reshape(-1)]).to(layout.dtype).contiguous()
        raw = flat.view(torch.uint8)
        out[e.layer, e.offset:e.offset + raw.numel()] = raw
    return out


def unpack(data: torch.Tensor, layout: PageLayout) -> dict[Target, tuple[torch.Tensor, torch.Tensor]]:
    """The (A, B) of every target from ``read_pages``' bytes (copies, on ``data``'s device)."""
    size = torch.empty((), dtype=layout.dtype).element_size()
    out = {}
    for e in layout.entries:
        na, nb = e.a_shape[0] * e.a_shape[1], e.b_shape[0] * e.b_shape[1]
        raw = data[e.layer, e.offset:e.offset + (na + nb) * size].clone()
        flat = raw.view(layout.dtype)
        out[e.target] = (flat[:na].view(e.a_shape), flat[na:].view(e.b_shape))
    return out


__all__ = ["PageLayout", "layer_of", "page_layout", "pack", "unpack"]
