"""Attention backends by name. Backends register here; ``get_backend`` picks one per device."""

from __future__ import annotations

import importlib

from pagedllm.attention.base import AttentionBackend
from pagedllm.attention.cpu import CpuBackend
from pagedllm.attention.torch_ref import TorchRefBackend

_BACKENDS: dict[str, type[AttentionBackend]] = {}
# Backends in optional modules (heavy or optional dependencies), imported on first request;
# the module registers itself.
_LAZY_MODULES = {"triton": "pagedllm.attention.triton"}


def register_backend(name: str, cls: type[AttentionBackend]) -> None:
    _BACKENDS[name] = cls


register_backend(TorchRefBackend.name, TorchRefBackend)
register_backend(CpuBackend.name, CpuBackend)


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_backend(name: str | None, device: str, batch_invariant: bool = False) -> AttentionBackend:
    """A fresh backend instance; ``name=None`` picks "cpu" on CPU and "triton" on CUDA.
    ``batch_invariant``: the backend's batch-invariant mode (``supports_batch_invariant``)."""
    if name is None:
        name = "triton" if str(device).startswith("cuda") else "cpu"
    if name not in _BACKENDS and name in _LAZY_MODULES:
        try:
            importlib.import_module(_LAZY_MODULES[name])
        except ImportError as e:
            raise ValueError(
                f"attention backend {name!r} could not be imported ({e}); available: "
                f"{', '.join(available_backends())}"
            ) from e
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; registered backends: "
            f"{', '.join(available_backends())}"
        )
    cls = _BACKENDS[name]
    if not batch_invariant:
        return cls()
    if not cls.supports_batch_invariant:
        ok = [n for n, c in sorted(_BACKENDS.items()) if c.supports_batch_invariant]
        raise ValueError(f"attention backend {name!r} has no batch-invariant mode; with "
                         f"--batch-invariant use --attention-backend {' or '.join(ok)}")
    return cls(batch_invariant=True)  # type: ignore[call-arg]
