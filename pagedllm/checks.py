"""Admission checks shared by the offline engine and the server: text must be valid Unicode (no
lone UTF-16 surrogates, which JSON's ``\\ud800`` escapes can smuggle in and no tokenizer can
encode), and every token id a request carries must lie in the vocabulary. Pure Python."""

from __future__ import annotations

import re
from collections.abc import Iterable

_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(text: str) -> str | None:
    """Where ``text`` holds a lone surrogate ("U+D800 at character 3"), or None."""
    m = _SURROGATE.search(text)
    return None if m is None else f"U+{ord(m.group()):04X} at character {m.start()}"


def check_text(field: str, text: str) -> None:
    where = lone_surrogate(text)
    if where is not None:
        raise ValueError(f"{field} contains a lone UTF-16 surrogate ({where}); send valid Unicode text")


def check_token_ids(field: str, ids: Iterable[int], vocab_size: int) -> None:
    """Raises ValueError("field=[...] ...") naming the ids outside [0, vocab_size)."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{field}={bad[:5]} {'is' if len(bad) == 1 else 'are'} outside the vocabulary "
                         f"[0, {vocab_size}); every token id must be in that range")
