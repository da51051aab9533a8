"""Assertions shared by the offline engine tests."""

from __future__ import annotations

from pagedllm import LLMEngine


def assert_idle(engine: LLMEngine) -> None:
    """No request left, every KV block back in the pool, the pool's invariants intact."""
    engine.check_integrity()
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
