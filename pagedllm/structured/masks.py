"""``TokenMasks``: one step's grammar masks as the runner receives them (in the step's
``ModelInput``), possibly still being computed. Imports nothing of the engine."""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

import numpy as np


def mask_words(vocab_size: int) -> int:
    """int32 words of one row's bitmask (bit t of word t // 32 = token t allowed)."""
    return (vocab_size + 31) // 32


class TokenMasks:
    """One step's grammar masks: ``rows`` index ``ModelInput.seqs`` (= ``SchedulerOutput.
    scheduled``); ``bits()`` is int32 [len(rows), mask_words(vocab)], waited for on first use.
    Pickled or encoded (``runner.model_input``), it is sent as its finished bits."""

    def __init__(self, rows: list[int], bits: np.ndarray, done: Future[float]) -> None:
        self.rows = rows
        self._bits = bits
        self._done = done
        self.compute_s = 0.0  # llguidance's time for the masks
        self.wait_s = 0.0  # how long the caller of bits() waited for them

    @classmethod
    def ready(cls, rows: list[int], bits: np.ndarray, compute_s: float = 0.0) -> TokenMasks:
        """Masks already computed (received from another process)."""
        done: Future[float] = Future()
        done.set_result(compute_s)
        return cls(rows, bits, done)

    def __reduce__(self) -> tuple[Any, ...]:
        bits = self.bits()
        return (TokenMasks.ready, (self.rows, bits, self.compute_s))

    def bits(self) -> np.ndarray:
        if not self._done.done():
            t0 = time.perf_counter()
            self.compute_s = self._done.result()
            self.wait_s = time.perf_counter() - t0
        else:
            self.compute_s = self._done.result()
        return self._bits
