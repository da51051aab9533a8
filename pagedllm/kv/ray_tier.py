"""The Ray KV tier: one named Ray actor holds an ``LRUBlockStore`` shared by every replica.

Replicas find it by name (``get_if_exists``), so the first one creates it and the others attach;
payloads travel through Ray's object store. Calls block with a timeout; ``SafeTier`` around this
turns a timeout or a dead actor into recompute.
"""

from __future__ import annotations

from typing import Any

from pagedllm.kv.ext_tier import LRUBlockStore, Payload

TIMEOUT_S = 10.0


class _TierActor:
    def __init__(self, budget_bytes: int) -> None:
        self.store = LRUBlockStore(budget_bytes)

    def put(self, block_hash: int, token_ids: list[int], payload: Payload) -> None:
        self.store.put(block_hash, token_ids, payload)

    def get(self, block_hashes: list[int], token_ids: list[list[int]]) -> list[Payload]:
        return self.store.get(block_hashes, token_ids)

    def stats(self) -> dict[str, int]:
        return {**self.store.stats, "used_bytes": self.store.used_bytes, "blocks": len(self.store)}


class RayTier:
    def __init__(self, name: str, budget_bytes: int, namespace: str = "pagedllm") -> None:
        import ray

        if not ray.is_initialized():
            ray.init(ignore_reinit_error=True, namespace=namespace)
        actor_cls: Any = ray.remote(num_cpus=0)(_TierActor)
        self._ray = ray
        self.actor = actor_cls.options(name=name, get_if_exists=True, lifetime=None).remote(budget_bytes)

    def put(self, block_hash: int, token_ids: list[int], payload: Payload) -> None:
        self.actor.put.remote(block_hash, list(token_ids), payload)  # fire and forget

    def get(self, block_hashes: list[int], token_ids: list[list[int]]) -> list[Payload]:
        ref = self.actor.get.remote(list(block_hashes), [list(t) for t in token_ids])
        return self._ray.get(ref, timeout=TIMEOUT_S)

    def stats(self) -> dict[str, int]:
        return self._ray.get(self.actor.stats.remote(), timeout=TIMEOUT_S)
