"""Quantized KV storage: int8 / fp8 values with per-token, per-head scales.

A quantized layer cache is a ``QuantizedKV(data, scale)`` passed where a plain cache tensor
would be (K and V are chosen separately: either may be plain while the other is quantized)::

    data   [num_blocks, block_size, Hkv, D]   int8 | float8_e4m3fn | float8_e5m2
    scale  [num_blocks, block_size, Hkv]      bfloat16, one per (slot, head)

    x[slot, h, :]  ~=  data[slot, h, :] * scale[slot, h]

Quantize on write (``quantize``), dequantize on load (``dequantize``, or the same arithmetic
inside a kernel). Why these choices:

- Per-token, per-head scales: a new token's scale depends only on that token, so writes never
  touch older slots and a block's bytes are final once written (prefix caching, copy-on-write
  and swap stay plain copies of data + scales).
- ``scale = amax / qmax`` rounded *up* to bf16 (``ceil_bf16``): bf16 has fp32's exponent range,
  so a scale can neither underflow nor overflow, costs 2 bytes instead of 4 (at head_dim 32 that
  is the difference between 47 % and 44 % saved against fp16), and rounding up means no element
  clips. Values are quantized with the stored (rounded) scale, so dequantization is exact
  arithmetic on what is stored: ``q * s`` is exact in fp32 (8-bit x 8-bit mantissas), and every
  backend dequantizes bit-identically.
- int8 rounds half up (``floor(y + 0.5)``), the same formula in torch and in the Triton kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Storage dtype names (config values) -> torch dtypes; "auto" (the model dtype) is not here.
QUANT_DTYPES: dict[str, torch.dtype] = {
    "int8": torch.int8,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
# The largest magnitude each storage dtype holds; scale = amax / QMAX.
QMAX: dict[torch.dtype, float] = {
    torch.int8: 127.0,
    torch.float8_e4m3fn: 448.0,
    torch.float8_e5m2: 57344.0,
}
SCALE_DTYPE = torch.bfloat16
_TINY = 1e-30  # amax floor: an all-zero row gets a tiny positive scale, never 0 / 0


@dataclass(frozen=True)
class QuantizedKV:
    """One layer's quantized K (or V) cache: values and their per-token, per-head scales."""

    data: torch.Tensor  # [num_blocks, block_size, Hkv, D] int8 / fp8
    scale: torch.Tensor  # [num_blocks, block_size, Hkv] bf16

    def __post_init__(self) -> None:
        assert self.data.dtype in QMAX, f"quantized KV data must be int8/fp8, got {self.data.dtype}"
        assert self.scale.dtype == SCALE_DTYPE and self.scale.shape == self.data.shape[:-1], (
            f"scale must be {SCALE_DTYPE} {tuple(self.data.shape[:-1])}, got "
            f"{self.scale.dtype} {tuple(self.scale.shape)}"
        )

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def dim(self) -> int:
        return self.data.dim()


KVCacheTensor = torch.Tensor | QuantizedKV  # what a backend receives as k_cache / v_cache


def raw(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors viewed as uint8 (same bits): CPU torch lacks fp8 ``index_copy_``/``equal``."""
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t


def ceil_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 x >= 0 rounded up to the next bf16 value (exact: clear the low 16 mantissa bits)."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0xFFFF) & -65536).view(torch.float32).to(SCALE_DTYPE)


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (values [..., D] of ``dtype``, scales [...] bf16), one scale per row."""
    qmax = QMAX[dtype]
    xf = x.float()
    amax = xf.abs().amax(dim=-1).clamp_min(_TINY)
    scale = ceil_bf16(amax / qmax)
    y = xf / scale.float().unsqueeze(-1)
    if dtype == torch.int8:
        q = torch.floor(y + 0.5).clamp_(-qmax, qmax).to(torch.int8)
    else:
        q = y.clamp_(-qmax, qmax).to(dtype)
    return q, scale


def dequantize(
    data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """values [..., D] * scales [...] -> [..., D] of ``dtype`` (computed in fp32)."""
    return (data.float() * scale.float().unsqueeze(-1)).to(dtype)


def load_blocks(cache: KVCacheTensor, index: torch.Tensor) -> torch.Tensor:
    """``cache[index]`` (index over blocks), dequantized to fp32 when the cache is quantized;
    a plain cache comes back in its own dtype (callers cast)."""
    if isinstance(cache, QuantizedKV):
        return dequantize(cache.data[index], cache.scale[index])
    return cache[index]


def write_slots(x: torch.Tensor, cache: KVCacheTensor, slot_mapping: torch.Tensor) -> None:
    """Scatter rows x [T, Hkv, D] into their slots, quantizing when the cache is quantized."""
    nb, bs, h, d = cache.shape
    if isinstance(cache, QuantizedKV):
        q, s = quantize(x, cache.data.dtype)
        raw(cache.data).view(nb * bs, h, d).index_copy_(0, slot_mapping, raw(q))
        cache.scale.view(nb * bs, h).index_copy_(0, slot_mapping, s)
    else:
        cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, x.to(cache.dtype))

