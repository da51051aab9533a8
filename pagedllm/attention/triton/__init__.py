"""Triton GPU attention kernels (optional dependency: ``pip install "pagedllm[cuda]"``).

Importing this package registers the "triton" backend. Without Triton installed the import fails
with an ImportError that says how to install it; nothing else in pagedllm imports this package
eagerly (the registry imports it on the first ``get_backend("triton", ...)``).
"""

from __future__ import annotations

try:
    import triton  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised where triton is absent
    raise ImportError(
        f'the "triton" attention backend needs Triton ({e}); install it with '
        f'pip install "pagedllm[cuda]"'
    ) from e

from pagedllm.attention.registry import register_backend
from pagedllm.attention.triton.backend import TritonBackend

register_backend(TritonBackend.name, TritonBackend)

__all__ = ["TritonBackend"]
