"""Build the KV tier that ``--kv-transfer-config`` names (``ray`` or ``inproc``), failure-safe,
and the engine's ``KVTransfer`` over it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pagedllm.kv.ext_tier import (
    KVTransferConfig,
    LRUBlockStore,
    SafeTier,
    payload_bytes,
    payload_matches,
)
from pagedllm.kv.transfer import KVTransfer

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig

_INPROC: dict[str, LRUBlockStore] = {}  # in-process tiers by name: engines of one process share
_INPROC_LOCK = threading.Lock()


def tier_name(config: KVTransferConfig) -> str:
    return str(config.kv_connector_extra_config.get("actor_name", "pagedllm-kv-tier"))


def make_tier(config: KVTransferConfig) -> SafeTier:
    """The tier ``config`` names, wrapped in ``SafeTier`` (failures become misses + a warning).
    ``inproc`` tiers of one name are one store in this process (engines side by side, tests);
    ``ray`` tiers of one name are one Ray actor in the cluster."""
    if config.kv_connector == "inproc":
        with _INPROC_LOCK:
            store = _INPROC.setdefault(tier_name(config), LRUBlockStore(int(config.kv_buffer_size)))
        return SafeTier(store)
    from pagedllm.kv.ray_tier import RayTier

    return SafeTier(RayTier(tier_name(config), int(config.kv_buffer_size)))


def make_transfer(config: EngineConfig, export: Callable[[list[int]], list[Any]],
                  layout: dict[str, tuple[tuple[int, ...], str]]) -> KVTransfer:
    """The engine's ``KVTransfer``: ``export`` reads device blocks (the runner's), ``layout`` is
    one block's payload as this engine stores it. Keys carry the model as named, its dtype, the
    KV dtypes, the block size and the layout, so engines that could not share a block never do."""
    kt = config.cache.kv_transfer
    assert kt is not None
    m, c = config.model, config.cache
    fingerprint = "|".join(map(str, (m.model, m.architecture, m.dtype, c.k_cache_dtype,
                                     c.v_cache_dtype, c.block_size, sorted(layout.items()))))
    return KVTransfer(make_tier(kt), c.block_size, fingerprint, produces=kt.produces,
                      consumes=kt.consumes, export=export,
                      fits=lambda p: payload_matches(p, layout), size=payload_bytes)
