"""The cluster-wide KV tier (issue #28 item 3): full blocks keyed by their chained prefix hash.

    put(h0, tokens0, payload0) ... put(h2, ...)     get([h0, h1, h2, h3]) -> [p0, p1, p2]
                                                    (the longest present prefix, verified)

A payload is a dict of tensors (the block's K/V per layer and, for int8/fp8 KV, their scales):
the tier stores it whole, so the scales travel with the data. Every entry keeps the block's token
ids; ``get`` takes the caller's token ids per block and stops at the first block whose stored
tokens differ (a hash collision or a corrupt entry), so a block is used only once verified.

``KVTransferConfig`` parses vLLM's ``--kv-transfer-config`` JSON; ``connector.make_tier`` builds the tier it
names. ``SafeTier`` wraps any tier so that a failing one degrades to "no hit" with a warning.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

CONNECTORS = ("ray", "inproc")
ROLES = ("kv_both", "kv_producer", "kv_consumer")
DEFAULT_BUDGET = 1 << 30  # bytes


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str
    kv_role: str = "kv_both"
    kv_buffer_size: int = DEFAULT_BUDGET  # the tier's byte budget (vLLM's field name)
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_connector not in CONNECTORS:
            raise ValueError(f"unknown kv_connector {self.kv_connector!r}; choose one of {CONNECTORS}")
        if self.kv_role not in ROLES:
            raise ValueError(f"unknown kv_role {self.kv_role!r}; choose one of {ROLES}")
        if int(self.kv_buffer_size) <= 0:
            raise ValueError(f"kv_buffer_size must be > 0, got {self.kv_buffer_size}")

    @property
    def produces(self) -> bool:
        return self.kv_role in ("kv_both", "kv_producer")

    @property
    def consumes(self) -> bool:
        return self.kv_role in ("kv_both", "kv_consumer")

    def check(self, prefix_caching: bool, window: int | None) -> None:
        """What the tier does not cover yet, refused by name (``EngineConfig`` calls this)."""
        for bad, why in [
            (not prefix_caching, "blocks are keyed by the prefix cache's hashes; drop "
             "--no-enable-prefix-caching"),
            (window is not None, "a sliding-window model frees blocks behind the window; use "
             "--no-free-window-blocks")]:
            if bad:
                raise ValueError(f"--kv-transfer-config: {why}, or drop --kv-transfer-config")

    @classmethod
    def parse(cls, text: str | dict[str, Any]) -> KVTransferConfig:
        """From the flag's JSON (or an already-parsed dict); clear errors for bad input."""
        if isinstance(text, str):
            try:
                text = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"--kv-transfer-config is not valid JSON: {e}") from None
        if not isinstance(text, dict):
            raise ValueError("--kv-transfer-config must be a JSON object")
        known = {"kv_connector", "kv_role", "kv_buffer_size", "kv_connector_extra_config"}
        unknown = sorted(set(text) - known)
        if unknown:
            raise ValueError(f"unknown --kv-transfer-config keys {unknown}; known: {sorted(known)}")
        if "kv_connector" not in text:
            raise ValueError("--kv-transfer-config needs a kv_connector")
        return cls(**text)


Payload = dict[str, "torch.Tensor"]


def payload_bytes(payload: Payload) -> int:
    return sum(t.numel() * t.element_size() for t in payload.values())


def payload_matches(payload: object, layout: dict[str, tuple[tuple[int, ...], str]]) -> bool:
    """Whether ``payload`` holds exactly ``layout``'s planes (name -> (shape, dtype name))."""
    if not isinstance(payload, dict) or set(payload) != set(layout):
        return False
    return all(tuple(payload[k].shape) == shape and str(payload[k].dtype) == dtype
               for k, (shape, dtype) in layout.items())


def merge_ranks(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One block's payload (or layout) from each tensor-parallel rank's, as one: rank r's planes
    under ``r<r>.``; with one rank, its own unchanged."""
    if len(parts) == 1:
        return parts[0]
    return {f"r{r}.{k}": v for r, part in enumerate(parts) for k, v in part.items()}


def rank_part(payload: dict[str, Any], rank: int, size: int) -> dict[str, Any]:
    """Rank ``rank``'s planes of a ``merge_ranks`` payload of ``size`` ranks."""
    if size == 1:
        return payload
    head = f"r{rank}."
    return {k[len(head):]: v for k, v in payload.items() if k.startswith(head)}


class KVTier(Protocol):
    def put(self, block_hash: int, token_ids: list[int], payload: Payload) -> None: ...

    def get(self, block_hashes: list[int], token_ids: list[list[int]]) -> list[Payload]: ...

    def sync(self) -> None:
        """Return once every put is visible to every reader."""


class LRUBlockStore:
    """Entries keyed by chained hash, with a byte budget; least recently used go first.

    The in-process tier, and the state the Ray actor holds."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET) -> None:
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[int, tuple[list[int], Payload, int]] = OrderedDict()
        self.stats = {"puts": 0, "evicted": 0, "hits": 0, "rejected": 0, "bytes_in": 0, "bytes_out": 0}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._entries

    def put(self, block_hash: int, token_ids: list[int], payload: Payload) -> None:
        size = payload_bytes(payload)
        if size > self.budget_bytes or block_hash in self._entries:
            if block_hash in self._entries:
                self._entries.move_to_end(block_hash)
            return
        self._entries[block_hash] = (list(token_ids), payload, size)
        self.used_bytes += size
        self.stats["puts"] += 1
        self.stats["bytes_in"] += size
        while self.used_bytes > self.budget_bytes:
            _, (_, _, old) = self._entries.popitem(last=False)
            self.used_bytes -= old
            self.stats["evicted"] += 1

    def sync(self) -> None:
        """Puts are stored at once: nothing to wait for."""

    def get(self, block_hashes: list[int], token_ids: list[list[int]]) -> list[Payload]:
        """Payloads for the longest prefix of ``block_hashes`` present with matching tokens."""
        out: list[Payload] = []
        for h, toks in zip(block_hashes, token_ids):
            entry = self._entries.get(h)
            if entry is None:
                break
            if entry[0] != list(toks):
                self.stats["rejected"] += 1
                break
            self._entries.move_to_end(h)
            out.append(entry[1])
            self.stats["bytes_out"] += entry[2]
        self.stats["hits"] += len(out)
        return out


class SafeTier:
    """Any tier, whose failures become "stored nothing" / "found nothing" plus one warning each."""

    def __init__(self, tier: KVTier) -> None:
        self.tier = tier
        self.failures = 0

    def _failed(self, op: str, e: BaseException) -> None:
        self.failures += 1
        logger.warning("KV tier %s failed (%s: %s); recomputing instead", op, type(e).__name__, e)

    def put(self, block_hash: int, token_ids: list[int], payload: Payload) -> None:
        try:
            self.tier.put(block_hash, token_ids, payload)
        except Exception as e:  # noqa: BLE001 - a tier must never fail a request
            self._failed("put", e)

    def sync(self) -> None:
        """Wait until what was put is visible to every reader."""
        try:
            self.tier.sync()
        except Exception as e:  # noqa: BLE001
            self._failed("put", e)

    def get(self, block_hashes: list[int], token_ids: list[list[int]]) -> list[Payload]:
        try:
            got = self.tier.get(block_hashes, token_ids)
        except Exception as e:  # noqa: BLE001
            self._failed("get", e)
            return []
        return list(got)[: len(block_hashes)]

