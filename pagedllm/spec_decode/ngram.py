"""Prompt lookup (n-gram) proposals: the tokens that followed the last occurrence of the
sequence's own suffix.

For n from ``prompt_lookup_max`` down to ``prompt_lookup_min``: if the last n tokens occurred
earlier in the sequence (prompt and output), propose the (up to) k tokens that followed their
latest earlier occurrence. Code repeats its context (names, argument lists, whole lines), so
these guesses are often right and cost no model at all. Pure numpy, no torch.

    tokens   [ ... a b c d e ... x y a b c ]      suffix "a b c" (n = 3) found at i
    proposal             [ d e ... ]              the k tokens after it
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def ngram_propose(tokens: Sequence[int] | np.ndarray, k: int, n_max: int, n_min: int) -> list[int]:
    """Up to ``k`` proposed next tokens of ``tokens`` (empty: no earlier match of any suffix of
    length ``n_min``..``n_max``)."""
    arr = np.asarray(tokens, dtype=np.int64)
    length = len(arr)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        windows = sliding_window_view(arr[: length - 1], n)  # windows ending before the last token
        hits = np.flatnonzero((windows == arr[length - n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n  # the latest occurrence's next token
            return arr[start : start + k].tolist()
    return []
