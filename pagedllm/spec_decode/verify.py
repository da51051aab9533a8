"""Verification of proposed tokens against the target model's own samples.

A verifying request with proposals d_1..d_k runs k + 1 query tokens (its last token, then the
proposals); the logits of row j are the target's distribution p_j of the token after d_1..d_j.
The sampler draws one token x_j per row, exactly as it would without speculation (greedy:
argmax; sampled: temperature, top-k/p, min-p, then the exponential race with the request's own
generator when it is seeded). The request keeps x_0 .. x_a, where a is the first row whose
x_a != d_{a+1} (a = k when every proposal matched):

    rows        0     1     2     3          k = 3 proposals d1 d2 d3
    query       t     d1    d2    d3
    target x    d1    d2    y     .          x_2 = y != d3: a = 2
    kept        d1    d2    y                2 accepted + the target's own token

Why this is the target's distribution: our proposals are single tokens (a point-mass draft q =
one-hot(d)), and for such a draft rejection sampling (accept d with probability
min(1, p(d) / q(d)) = p(d), else draw from the residual max(p - q, 0) / Z = p without d) is the
same as drawing x ~ p and accepting exactly when x == d. Rows past the first mismatch are
discarded, so the kept tokens are ancestral samples of the target: greedy output is identical
to no speculation, and so is a seeded request's, because ``SeededRewind`` puts its generator
back where plain sampling would have left it (one draw per kept token). The draft model's
proposals are its greedy tokens (spec_decode/draft.py), point masses too, so the same rule
verifies them; a sampled draft with a full distribution q would need the general rule
min(1, p/q) with the residual (not built: it accepts more often only at high temperatures).
Torch only for the generators; the acceptance itself is plain Python over the fetched token ids.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, TypeVar

import torch

from pagedllm.runner.model_input import SeqInput


class _Token(Protocol):
    token_id: int


T = TypeVar("T", bound=_Token)


def accept(rows: list[SeqInput], tokens: list[T], sampled: dict[str, T],
           accepted: dict[str, list[T]]) -> None:
    """``rows``: the scheduled request of each sampled row (a verifying request's k + 1 rows in
    a row), ``tokens``: the target's token of each row. Fills ``sampled`` (the last kept token
    of every request) and ``accepted`` (a verifying request's accepted proposals)."""
    j = 0
    while j < len(rows):
        s = rows[j]
        spec = s.spec_token_ids
        own = tokens[j : j + len(spec) + 1]
        a = 0
        while a < len(spec) and own[a].token_id == spec[a]:
            a += 1
        rid = s.request_id
        sampled[rid] = own[a]
        if spec:
            accepted[rid] = own[:a]
        j += len(spec) + 1


class SeededRewind:
    """Seeded verifying requests: the generator state before the step's draws, restored and
    advanced by one draw per kept token afterwards (so the k + 1 rows' draws cost the stream
    only what the kept tokens would have cost without speculation)."""

    def __init__(self, rows: list[SeqInput], generators: dict[str, torch.Generator]) -> None:
        self.generators = generators
        self.saved: dict[str, tuple[int, torch.Tensor | None]] = {}
        for s in rows:
            if s.spec_token_ids and s.params.seed is not None and s.request_id not in self.saved:
                gen = generators.get(s.request_id)
                self.saved[s.request_id] = (len(s.spec_token_ids),
                                            None if gen is None else gen.get_state())

    def rewind(self, accepted: Mapping[str, Sequence[object]], vocab_size: int) -> None:
        for rid, (k, state) in self.saved.items():
            gen = self.generators.get(rid)  # made by the sampling metadata if it was not there
            kept = len(accepted.get(rid, ())) + 1
            if gen is None or kept == k + 1:
                continue  # a greedy request draws nothing; all rows kept: nothing to undo
            if state is None:
                gen.manual_seed(gen.initial_seed())
            else:
                gen.set_state(state)
            scratch = torch.empty(vocab_size, device=gen.device)
            for _ in range(kept):
                scratch.exponential_(generator=gen)
