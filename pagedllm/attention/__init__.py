"""Paged attention: the backend interface, per-step metadata, and the backend registry."""

from pagedllm.attention.base import AttentionBackend, AttentionMetadata
from pagedllm.attention.registry import get_backend, register_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_backend", "register_backend"]
