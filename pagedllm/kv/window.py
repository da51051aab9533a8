"""Sliding-window attention: which KV blocks a request still needs, and windowed prefix hits.

A query at position p attends keys in ``(p - window, p]`` (``window`` keys, itself included:
transformers' ``sliding_window_overlay``, ``kv_idx > q_idx - sliding_window``). Once a request
has computed ``c`` tokens every later query sits at ``>= c``, so keys before ``c - window + 1``
are never read again, and a block wholly before that position can go back to the pool::

    window 6, block_size 4, c = 13 computed
    positions   0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13 ...
    table      [  None  |    5    |     2     |    9   ]   keys >= 13 - 6 + 1 = 8 are needed:
                 freed     freed      held          held    block 0 and 1 wholly before 8

The table keeps a placeholder (``None``) for each freed block, so positions stay addressable;
placeholders are always a leading run. Held, a request spans at most ``blocks_spanned(window -
1 + n)`` blocks while a chunk of ``n`` new tokens runs (``ceil(window / block_size) + 1`` when
decoding), whatever its length.

The pool is shared by every layer (one block id indexes every layer's K and V), so blocks are
freed only when *every* layer attends within the window (``ModelConfig.kv_sliding_window``); a
model mixing full-attention and windowed layers keeps all its blocks.
"""

from __future__ import annotations

from collections.abc import Sequence


def blocks_spanned(num_positions: int, block_size: int) -> int:
    """The most blocks ``num_positions`` consecutive positions can touch (worst alignment)."""
    if num_positions <= 0:
        return 0
    return (num_positions + block_size - 2) // block_size + 1


def max_blocks_held(window: int, block_size: int, num_new_tokens: int = 1) -> int:
    """Blocks a windowed request holds at most while ``num_new_tokens`` new tokens are computed:
    its window before the chunk (``window - 1`` keys) plus the chunk."""
    return blocks_spanned(window - 1 + num_new_tokens, block_size)


def min_blocks_to_serve(num_prompt_tokens: int, block_size: int, window: int | None,
                        chunked_prefill: bool) -> int:
    """The fewest blocks a prompt and its first generated token can be served in: all of them,
    or with a sliding window its window plus the smallest chunk (one token, or the whole prompt
    without chunked prefill)."""
    total = -(-(num_prompt_tokens + 1) // block_size)
    if window is None:
        return total
    first = 1 if chunked_prefill else num_prompt_tokens
    return min(total, max(max_blocks_held(window, block_size, first),
                          max_blocks_held(window, block_size)))


class SlidingWindow:
    """The window arithmetic for one manager (one window, one block size)."""

    def __init__(self, window: int, block_size: int) -> None:
        if window < 1:
            raise ValueError(f"sliding_window={window} must be >= 1")
        self.window = window
        self.block_size = block_size

    def first_needed_block(self, num_computed_tokens: int) -> int:
        """Index of the first block a request with ``num_computed_tokens`` computed tokens still
        reads; every block before it lies wholly before the window of every later query. The
        block of the last computed token is always kept (so a table always holds a block once
        anything is computed)."""
        c = num_computed_tokens
        if c <= 0:
            return 0
        return min(max(0, c - self.window + 1), c - 1) // self.block_size

    def longest_hit(self, cached: Sequence[bool]) -> int:
        """Number of leading prompt blocks a prefix hit covers, given which of the prompt's full
        blocks are in the cache: the largest ``k`` whose needed blocks ``[first_needed_block(k *
        block_size), k)`` are all cached (those before may be gone). 0 = no hit."""
        best, last_miss = 0, -1
        for i, hit in enumerate(cached):
            if not hit:
                last_miss = i
            elif last_miss < self.first_needed_block((i + 1) * self.block_size):
                best = i + 1
        return best
