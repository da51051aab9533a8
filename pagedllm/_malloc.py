"""glibc's malloc keeps the memory a CPU engine's steps free, instead of giving it back to Linux.

torch's CPU allocator has no cache: every activation of every step is a ``malloc`` and a ``free``.
glibc serves a request above its mmap threshold (128 KiB, raised as big blocks are freed, to at
most 32 MiB) with fresh pages from ``mmap`` and unmaps them on ``free``, and gives the top of its
heap back once more than twice that threshold is free there. A step's large activations (the
125M model's prefill steps: a 2048 x 4096 float32 ``gate_up`` output is 32 MiB, in every layer)
therefore come back from the kernel as new pages, zeroed, one page fault per 4 KiB: about
50,000 faults per run of the 64-request workload of ``bench throughput``. On a VM whose kernel
reports free memory to the host (free page reporting, as on the machine the README measures),
each freed 2 MiB block also goes back to the host, and touching it again faults there too.

``keep_freed_memory`` raises the mmap threshold to ``MMAP_THRESHOLD`` and the trim threshold to
``TRIM_THRESHOLD`` (``mallopt``), so a step's blocks are reused from the heap by the next step:
0-200 faults per run. The price is that the process keeps, after a step, up to
``TRIM_THRESHOLD`` of free heap (in practice the largest step's activations, which the next
step reuses); allocations above ``MMAP_THRESHOLD`` still map and unmap. The model runner calls
it on CPU after it allocated the KV pool (so the weights and the pool are placed as before).
It is process-wide and stays for the process's life. A thread other than the main one (the
server's engine thread) allocates from its own glibc arena, whose heaps are at most 64 MiB:
there blocks up to ~32 MiB are reused, larger ones are still mapped afresh each time.

The price is paid while the engine works, not while it idles: ``IdleRelease`` collects Python's
cyclic garbage and gives every arena's free pages back (``malloc_trim(0)``) once an engine loop
has had nothing to do for ``IDLE_RELEASE_S``. Without it a server kept its largest burst's memory
for good: one round of hostile input (1 MB prompts tokenized on the engine thread, 960 sequences
queued and dropped) took it from 510 to 1091 MiB at idle, then 1300 and 1364 after two more
rounds. ``malloc_info`` showed where: 496 of the engine thread's arena's 496 MiB free, in 64 MiB
heaps that glibc shrinks only when more than the trim threshold (1 GiB) is free at a heap's top,
i.e. never; and ``gc`` found the refused prompts' token ids (~500,000 each) kept in cycles of an
exception and the frames on its traceback until Python's next full collection. With the release,
the same rounds end at 530-560 MiB. It runs once per idle spell, never per step, on the engine
thread, and costs what giving the pages back costs (150-230 ms after a round on a loaded 2-core
VM; the server keeps its start-up objects out of the collection, ``gc.freeze``); the next burst
faults its pages in again. It does not depend on ``PAGEDLLM_MALLOC``.

``PAGEDLLM_MALLOC=auto`` (the default) applies it under glibc; ``PAGEDLLM_MALLOC=0`` leaves
malloc alone, as do a user's own glibc settings (``MALLOC_*_`` variables, ``GLIBC_TUNABLES``)
and a preloaded allocator (``LD_PRELOAD``: tcmalloc, jemalloc, ...). The vLLM benchmark backend
runs in its own process and is not affected.
"""

from __future__ import annotations

import ctypes
import gc
import os
import time
from collections.abc import Callable, Mapping

from pagedllm import envs
from pagedllm.envs import auto_or_off
from pagedllm.logging_utils import init_logger

logger = init_logger(__name__)

MMAP_THRESHOLD = 256 << 20
TRIM_THRESHOLD = 1 << 30
IDLE_RELEASE_S = 1.0  # idle time after work before the free heap goes back to Linux
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
USER_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
             "MALLOC_MMAP_MAX_", "GLIBC_TUNABLES", "LD_PRELOAD")

_applied: str | None = None  # the log line, once applied or declined


def glibc() -> ctypes.CDLL | None:
    """The running C library when it is glibc (it has ``gnu_get_libc_version`` and
    ``mallopt``); None elsewhere (musl, macOS, Windows)."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - raises AttributeError where not glibc
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError, TypeError):
        return None
    return libc


def choose(setting: str, env: Mapping[str, str], has_glibc: bool) -> tuple[bool, str]:
    """(apply the settings?, why) for PAGEDLLM_MALLOC=``setting`` in environment ``env``."""
    if not auto_or_off("PAGEDLLM_MALLOC", setting):
        return False, "PAGEDLLM_MALLOC=0"
    user = [v for v in USER_VARS if env.get(v)]
    if user:
        return False, f"{user[0]} set by the user"
    if not has_glibc:
        return False, "not glibc"
    return True, (f"mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim threshold "
                  f"{TRIM_THRESHOLD >> 20} MiB")


def keep_freed_memory(env: Mapping[str, str] | None = None) -> str:
    """Apply the settings once per process (where ``choose`` says so); the line for the log."""
    global _applied
    if _applied is None:
        env = os.environ if env is None else env
        libc = glibc()
        on, why = choose(envs.get("PAGEDLLM_MALLOC", env) or "auto", env, libc is not None)
        if on and libc is not None:
            ok = (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
                  and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)
            on, why = ok, why if ok else "glibc refused mallopt"
        _applied = (f"malloc keeps freed memory for the next step: {'on' if on else 'off'} "
                    f"({why}{'; PAGEDLLM_MALLOC=0 turns it off' if on else ''})")
    return _applied


def release_free_memory() -> bool:
    """Free Python's cyclic garbage, then give every glibc arena's free pages back to Linux
    (``malloc_trim(0)``); False where the C library is not glibc (the garbage is still freed).

    The collection comes first because a refused request's data often sits in a cycle until
    Python's rare full collection: an exception kept in a local of a frame on its own traceback
    holds that frame's locals, e.g. the ~500,000 token ids of a 1 MB prompt refused as too long.
    Memory in use is untouched; the next allocations fault their pages in again."""
    gc.collect()
    libc = glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


class IdleRelease:
    """When an engine loop goes idle, give the memory its work freed back to Linux, once.

    The loop waits for work at most ``wait_s`` seconds (None: for ever), calls ``worked()``
    whenever it did something (a step, a command) and ``idle()`` when a wait ran out. So the
    release runs once, ``after_s`` after the last work, and never while the engine is busy or
    already released: a server that idles between bursts keeps only what it uses, and one
    under steady load keeps its freed blocks for the next step (``keep_freed_memory``).
    """

    def __init__(self, after_s: float = IDLE_RELEASE_S,
                 release: Callable[[], object] = release_free_memory) -> None:
        if after_s <= 0:
            raise ValueError(f"after_s={after_s} must be > 0")
        self.after_s = after_s
        self._release = release
        self._pending = False  # work was done since the last release
        self.releases = 0
        self.seconds = 0.0  # spent releasing, all releases together
        self.last_s = 0.0  # the last release

    def worked(self) -> None:
        self._pending = True

    @property
    def wait_s(self) -> float | None:
        """How long the loop may block for work before ``idle()`` is due."""
        return self.after_s if self._pending else None

    def idle(self) -> bool:
        """The wait for work ran out: release, if there was work since the last release."""
        if not self._pending:
            return False
        self._pending = False
        t0 = time.perf_counter()
        self._release()
        self.last_s = time.perf_counter() - t0
        self.releases += 1
        self.seconds += self.last_s
        logger.debug("idle: gave freed memory back in %.0f ms (release %d)", self.last_s * 1e3,
                     self.releases)
        return True
