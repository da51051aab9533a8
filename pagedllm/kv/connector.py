"""Build the KV tier that ``--kv-transfer-config`` names (``ray`` or ``inproc``), failure-safe."""

from __future__ import annotations

from pagedllm.kv.ext_tier import KVTransferConfig, LRUBlockStore, SafeTier


def make_tier(config: KVTransferConfig) -> SafeTier:
    """The tier ``config`` names, wrapped in ``SafeTier`` (failures become misses + a warning)."""
    if config.kv_connector == "inproc":
        return SafeTier(LRUBlockStore(int(config.kv_buffer_size)))
    from pagedllm.kv.ray_tier import RayTier

    name = str(config.kv_connector_extra_config.get("actor_name", "pagedllm-kv-tier"))
    return SafeTier(RayTier(name, int(config.kv_buffer_size)))
