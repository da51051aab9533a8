"""Transparent huge pages for torch's large CPU allocations, chosen at import (imported by
``pagedllm/__init__.py``, before pagedllm allocates anything).

A decode step streams every weight from memory (the 125M model: ~500 MB in float32, a few rows
each) and reads each running request's K/V blocks, which lie anywhere in a pool of gigabytes. On
4 KiB pages that is a TLB miss every few KiB. torch's CPU allocator can ask Linux for 2 MiB pages
(``THP_MEM_ALLOC_ENABLE=1``: allocations of 2 MiB and more are 2 MiB aligned and
``madvise(MADV_HUGEPAGE)``), which covers the weights, the KV pool and the large activations.
Measured (README "CPU fast path"): the 125M model's linear layers of one decode step at 15 rows,
one thread, 21.2 vs 24.2 ms in float32, 13.4 vs 14.3 ms in bfloat16 before the GEMMs prefetched
their next panel; with that prefetch 17.8 vs 18.2-18.9 ms and 8.6 vs 8.7-9.7 ms, and the whole
workload within noise.

``PAGEDLLM_THP=auto`` (the default) sets ``THP_MEM_ALLOC_ENABLE=1`` where the kernel gives huge
pages on request (``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` or ``always``);
``PAGEDLLM_THP=0`` leaves torch's default. A user's own ``THP_MEM_ALLOC_ENABLE`` is left alone.
torch reads the variable at its first allocation of 2 MiB or more, so a program that made one
before importing pagedllm keeps 4 KiB pages. ``SET_BY_PAGEDLLM`` names the variable where
pagedllm set it, else None (the vLLM benchmark backend removes it: vLLM runs at the user's
environment); ``CHOICE`` is the line for the log.
"""

from __future__ import annotations

import os

from pagedllm import envs
from pagedllm.envs import auto_or_off

VAR = "THP_MEM_ALLOC_ENABLE"
SYSFS = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode(path: str = SYSFS) -> str | None:
    """The kernel's THP mode (``always``, ``madvise`` or ``never``: the bracketed word), or None
    where it cannot be read (not Linux, no THP)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def choose(setting: str, mode: str | None, user_value: str | None) -> tuple[bool, str]:
    """(set THP_MEM_ALLOC_ENABLE=1?, why) for PAGEDLLM_THP=``setting``, kernel mode ``mode``."""
    if user_value is not None:
        return False, f"{VAR}={user_value} set by the user"
    if not auto_or_off("PAGEDLLM_THP", setting):
        return False, "PAGEDLLM_THP=0"
    if mode not in ("madvise", "always"):
        return False, f"the kernel gives no huge pages (transparent_hugepage: {mode or 'unknown'})"
    return True, f"transparent_hugepage: {mode}"


_on, _why = choose(envs.get("PAGEDLLM_THP") or "auto", thp_mode(), os.environ.get(VAR))
SET_BY_PAGEDLLM: str | None = VAR if _on else None  # as _openmp.SET_BY_PAGEDLLM: the name
if SET_BY_PAGEDLLM:
    os.environ[VAR] = "1"
CHOICE = (f"huge pages for large CPU tensors: {'on' if SET_BY_PAGEDLLM else 'off'} ({_why}; "
          f"PAGEDLLM_THP=0 turns it off)")
