"""``TokenMasks``: one step's grammar masks as the runner receives them (with the
``SchedulerOutput``), possibly still being computed. Imports nothing of the engine."""

from __future__ import annotations

import time
from concurrent.futures import Future

import numpy as np


def mask_words(vocab_size: int) -> int:
    """int32 words of one row's bitmask (bit t of word t // 32 = token t allowed)."""
    return (vocab_size + 31) // 32


class TokenMasks:
    """One step's grammar masks: ``rows`` index ``SchedulerOutput.scheduled``; ``bits()`` is
    int32 [len(rows), mask_words(vocab)], waited for on first use."""

    def __init__(self, rows: list[int], bits: np.ndarray, done: Future[float]) -> None:
        self.rows = rows
        self._bits = bits
        self._done = done
        self.compute_s = 0.0  # llguidance's time for the masks
        self.wait_s = 0.0  # how long the caller of bits() waited for them

    def bits(self) -> np.ndarray:
        if not self._done.done():
            t0 = time.perf_counter()
            self.compute_s = self._done.result()
            self.wait_s = time.perf_counter() - t0
        else:
            self.compute_s = self._done.result()
        return self._bits
