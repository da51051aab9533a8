"""The host-memory tier: host blocks of swapped-out requests, and the swap plans to and from it.

    device pool   [ 0 1 2 3 4 5 6 7 ]        swap_out(r, [5, 2, 7]) -> (5, 0) (2, 1) (7, 2)
    host pool     [ 0 1 2 3 ]                r now holds host blocks [0, 1, 2]
                  swap_in(r, [1, 3, 4])  ->  (0, 1) (1, 3) (2, 4); host blocks freed

The tier only plans and keeps its own books: it returns (src, dst) pairs that the runner moves in
one batch per direction. Which device blocks a request gives up or receives is the manager's
business (``KVCacheManager.swap_out`` / ``swap_in``); so are its prefix hashes.
"""

from __future__ import annotations

from collections.abc import KeysView


class HostTier:
    """``num_blocks`` host blocks; a request is swapped out iff it holds some (``holds``)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, ...
        self._held: dict[str, list[int]] = {}  # request id -> host block ids, in table order
        self.stats = {"out": 0, "in": 0}  # blocks moved, per direction

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def requests(self) -> KeysView[str]:
        """Ids of the swapped-out requests."""
        return self._held.keys()

    def holds(self, request_id: str) -> bool:
        return request_id in self._held

    def blocks_of(self, request_id: str) -> list[int]:
        """A copy of the swapped-out request's host block ids, in table order."""
        return list(self._held[request_id])

    def num_blocks_of(self, request_id: str) -> int:
        """Host blocks the swapped-out request holds (the device blocks its swap-in needs)."""
        return len(self._held[request_id])

    def swap_out(self, request_id: str, device_blocks: list[int]) -> list[tuple[int, int]] | None:
        """Host blocks for ``device_blocks`` (the request's table, in order): (device, host)
        pairs to copy, or None (nothing changed) if the tier lacks room."""
        if len(device_blocks) > len(self._free):
            return None
        host = [self._free.pop() for _ in device_blocks]
        self._held[request_id] = host
        self.stats["out"] += len(host)
        return list(zip(device_blocks, host))

    def swap_in(self, request_id: str, device_blocks: list[int]) -> list[tuple[int, int]]:
        """Release the request's host blocks into ``device_blocks``: (host, device) pairs."""
        host = self._held.pop(request_id)
        assert len(host) == len(device_blocks), "swap_in needs one device block per host block"
        self._free.extend(reversed(host))
        self.stats["in"] += len(host)
        return list(zip(host, device_blocks))

    def drop(self, request_id: str) -> bool:
        """Free a swapped-out request's host blocks without copying them back (it finished)."""
        host = self._held.pop(request_id, None)
        if host is None:
            return False
        self._free.extend(reversed(host))
        return True

    def check_integrity(self) -> None:
        ids = sorted([*(h for hs in self._held.values() for h in hs), *self._free])
        assert ids == list(range(self.num_blocks)), f"host blocks lost or doubled: {ids}"
