"""Routing policies: which data-parallel replica serves a request (``--routing-policy``).
Pure Python, no torch: unit-tested with made-up loads and KV events.

- ``round_robin``: replicas in turn (the live ones).
- ``least_load``: the replica with the fewest requests routed there and not finished (running +
  waiting + on their way), then the lowest KV usage.
- ``cache_aware`` (default): the replica holding the longest exact prefix of the prompt, by the
  chained block hashes of its KV events plus the blocks of requests routed there and not yet
  finished ("soon cached": concurrent requests with a new shared prefix land together), unless
  the load is out of balance. As Ray Serve's ``PrefixCacheAffinityRouter`` and SGLang's
  ``cache_aware`` router, but the match is exact (``prefix_index``)::

      loads imbalanced (max - min requests > threshold)?  ── yes ─▶ least loaded      "balance"
          │ no
      longest match > 0 blocks?  ── yes ─▶ least loaded of the longest matches        "cache"
          │ no
      least loaded, then the fewest (soon) cached blocks: room for a new prefix       "load"

Ties go to the replica after the last one chosen, so equal replicas take turns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from pagedllm.kv.events import KVEventBatch
from pagedllm.router.prefix_index import ReplicaPrefixIndex

ROUTING_POLICIES = ("round_robin", "least_load", "cache_aware")
IMBALANCE_THRESHOLD = 8  # requests; Ray Serve's default is 10, SGLang's 64 (absolute)


class ReplicaLoad(NamedTuple):
    """A live replica as the router sees it when it routes."""

    replica: int
    num_requests: int  # routed there and not finished: running + waiting + in transit
    kv_usage: float = 0.0  # fraction of its KV blocks in use (its latest step record)


class Decision(NamedTuple):
    replica: int
    matched_blocks: int  # leading prompt blocks cached or soon cached there
    why: str  # "round_robin" | "load" | "balance" | "cache"


class RoutingPolicy:
    """Chooses among the live replicas; told what was routed, what finished, and (cache_aware)
    each replica's KV events. ``hashes``: the prompt's full blocks' chained hashes
    (``prefix_index.request_block_hashes``), ``lookup`` how many of them a hit may cover."""

    name = ""
    uses_hashes = False  # the client computes hashes only for a policy that reads them

    def __init__(self) -> None:
        self._last = -1

    def choose(self, hashes: Sequence[str], lookup: int,
               replicas: Sequence[ReplicaLoad]) -> Decision:
        raise NotImplementedError

    def routed(self, replica: int, hashes: Sequence[str]) -> None:
        """A request with these blocks was sent to ``replica``."""

    def finished(self, replica: int, hashes: Sequence[str]) -> None:
        """A request routed to ``replica`` ended (or moved away)."""

    def on_kv_events(self, replica: int, batch: KVEventBatch) -> None:
        """A step's KV cache events of ``replica``."""

    def remove(self, replica: int) -> None:
        """``replica`` left routing (it died)."""

    def _turn(self, r: ReplicaLoad, total: int) -> int:
        """0 for the replica right after the last one chosen, then up."""
        return (r.replica - self._last - 1) % total

    def _pick(self, replicas: Sequence[ReplicaLoad], matched: int, why: str,
              extra: dict[int, int] | None = None) -> Decision:
        """The least loaded (requests, then KV usage, then ``extra``), ties in turn."""
        if not replicas:
            raise ValueError("no live replica to route to")
        total = max(r.replica for r in replicas) + 1
        best = min(replicas, key=lambda r: (r.num_requests, r.kv_usage,
                                            0 if extra is None else extra[r.replica],
                                            self._turn(r, total)))
        self._last = best.replica
        return Decision(best.replica, matched, why)


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def choose(self, hashes: Sequence[str], lookup: int,
               replicas: Sequence[ReplicaLoad]) -> Decision:
        if not replicas:
            raise ValueError("no live replica to route to")
        total = max(r.replica for r in replicas) + 1
        nxt = min(replicas, key=lambda r: self._turn(r, total))
        self._last = nxt.replica
        return Decision(nxt.replica, 0, "round_robin")


class LeastLoad(RoutingPolicy):
    name = "least_load"

    def choose(self, hashes: Sequence[str], lookup: int,
               replicas: Sequence[ReplicaLoad]) -> Decision:
        return self._pick(replicas, 0, "load")


class CacheAware(RoutingPolicy):
    name = "cache_aware"
    uses_hashes = True

    def __init__(self, imbalance_threshold: int = IMBALANCE_THRESHOLD) -> None:
        super().__init__()
        if imbalance_threshold < 0:
            raise ValueError(f"imbalance_threshold={imbalance_threshold} must be >= 0")
        self.imbalance_threshold = imbalance_threshold
        self.index: dict[int, ReplicaPrefixIndex] = {}

    def _of(self, replica: int) -> ReplicaPrefixIndex:
        idx = self.index.get(replica)
        if idx is None:
            idx = self.index[replica] = ReplicaPrefixIndex()
        return idx

    def choose(self, hashes: Sequence[str], lookup: int,
               replicas: Sequence[ReplicaLoad]) -> Decision:
        if not replicas:
            raise ValueError("no live replica to route to")
        loads = [r.num_requests for r in replicas]
        if max(loads) - min(loads) > self.imbalance_threshold:
            return self._pick(replicas, 0, "balance")
        matched = {r.replica: self._of(r.replica).match(hashes, lookup) for r in replicas}
        best = max(matched.values())
        if best > 0:
            return self._pick([r for r in replicas if matched[r.replica] == best], best, "cache")
        sizes = {r.replica: self._of(r.replica).size for r in replicas}
        return self._pick(replicas, 0, "load", sizes)

    def routed(self, replica: int, hashes: Sequence[str]) -> None:
        self._of(replica).add_pending(hashes)

    def finished(self, replica: int, hashes: Sequence[str]) -> None:
        if replica in self.index:
            self.index[replica].drop_pending(hashes)

    def on_kv_events(self, replica: int, batch: KVEventBatch) -> None:
        self._of(replica).apply(batch)

    def remove(self, replica: int) -> None:
        self.index.pop(replica, None)


def make_policy(name: str, imbalance_threshold: int = IMBALANCE_THRESHOLD) -> RoutingPolicy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    if name == "cache_aware":
        return CacheAware(imbalance_threshold)
    raise ValueError(f"--routing-policy {name!r}: choose {', '.join(ROUTING_POLICIES)}")
