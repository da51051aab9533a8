"""When to propose: the adaptive rule. Pure Python.

Verification is nearly free while a step is memory-bound (every weight is streamed once for a
handful of rows either way) and a rejected proposal then costs little; it stops being free when
the batch is large enough that the k extra rows per request make the step compute-bound. So:

  * batch: no request proposes in a step where more than ``disable_by_batch_size`` requests are
    decoding (vLLM's ``speculative_disable_by_batch_size``; the default is where the measured
    on/off ratio crossed 1.0: the README's "Speculative decoding" section);
  * per request: over its last ``acceptance_window`` proposed tokens, if fewer than
    ``min_acceptance_rate`` were accepted, the request stops proposing for ``backoff_steps``
    steps, then starts again with a fresh window (text that stopped repeating may repeat again).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedllm.spec_decode.config import SpeculativeConfig


@dataclass
class _History:
    recent: deque[tuple[int, int]] = field(default_factory=deque)  # (proposed, accepted)
    proposed: int = 0  # sums over ``recent``
    accepted: int = 0
    paused_until: int = 0  # step number


class AdaptiveRule:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._history: dict[str, _History] = {}
        self.num_backoffs = 0

    def batch_allows(self, num_decoding: int) -> bool:
        limit = self.config.disable_by_batch_size
        return limit is None or num_decoding <= limit

    def request_allows(self, request_id: str, step: int) -> bool:
        h = self._history.get(request_id)
        return h is None or step >= h.paused_until

    def record(self, request_id: str, proposed: int, accepted: int, step: int) -> None:
        """One verification of ``request_id`` at ``step``: ``accepted`` of ``proposed``."""
        c = self.config
        h = self._history.setdefault(request_id, _History())
        h.recent.append((proposed, accepted))
        h.proposed += proposed
        h.accepted += accepted
        while h.recent and h.proposed - h.recent[0][0] >= c.acceptance_window:
            p, a = h.recent.popleft()
            h.proposed -= p
            h.accepted -= a
        if h.proposed >= c.acceptance_window and h.accepted < c.min_acceptance_rate * h.proposed:
            self._history[request_id] = _History(paused_until=step + 1 + c.backoff_steps)
            self.num_backoffs += 1

    def forget(self, request_id: str) -> None:
        self._history.pop(request_id, None)
