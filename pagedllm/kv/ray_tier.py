"""The Ray KV tier: one named Ray actor holds an ``LRUBlockStore`` shared by every replica.

Replicas find it by name in the ``pagedllm`` namespace (``get_if_exists``), so the first one
creates it and the others attach; it is detached, so it outlives the replica that made it (a
replica killed under load leaves the tier whole). Payloads travel through Ray's object store.
``put`` does not wait, ``sync`` (after a step's puts) and ``get`` block with a timeout;
``SafeTier`` around this turns a timeout or a dead actor into recompute.

A process not in Ray yet joins the cluster ``RAY_ADDRESS`` names (the data-parallel front end
sets it for its replica processes), else starts a local one.
"""

from __future__ import annotations

import os
from typing import Any

from pagedllm.distributed.ray_init import join_ray
from pagedllm.kv.ext_tier import KVTransferConfig, LRUBlockStore, Payload

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

        join_ray()
        actor_cls: Any = ray.remote(num_cpus=0)(_TierActor)
        self._ray = ray
        self._puts: list[Any] = []  # refs of the puts not synced yet
        self.actor = actor_cls.options(name=name, namespace=namespace, get_if_exists=True,
                                       lifetime="detached").remote(budget_bytes)

    def put(self, block_hash: int, token_ids: list[int], payload: Payload) -> None:
        self._puts.append(self.actor.put.remote(block_hash, list(token_ids), payload))

    def sync(self) -> None:
        """Wait until the actor holds every block put so far: another replica may ask for them
        as soon as this one's step outputs are out (Ray orders one caller's calls, not two's)."""
        puts, self._puts = self._puts, []
        self._ray.get(puts, timeout=TIMEOUT_S)

    def get(self, block_hashes: list[int], token_ids: list[list[int]]) -> list[Payload]:
        ref = self.actor.get.remote(list(block_hashes), [list(t) for t in token_ids])
        return self._ray.get(ref, timeout=TIMEOUT_S)

    def stats(self) -> dict[str, int]:
        return self._ray.get(self.actor.stats.remote(), timeout=TIMEOUT_S)


def share_ray_cluster(config: KVTransferConfig) -> None:
    """Replica processes that share a ``ray`` tier must join one cluster: start (or join) it
    here and name it to them in ``RAY_ADDRESS``, which the processes started next inherit."""
    if config.kv_connector != "ray":
        return
    import ray

    join_ray()
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
