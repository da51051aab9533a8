"""OpenMP's wait policy, chosen before torch loads its OpenMP runtime (imported by
``pagedllm/__init__.py``, which runs before any pagedllm module imports torch).

torch's libgomp makes a thread that finished its share of a parallel region spin for a while
(``GOMP_SPINCOUNT``, ~300k iterations) before it sleeps. Every op of a decode step is such a
region, with a little Python in between. Which policy pays depends on the machine:

- cores that other processes also use: spinning threads take the CPU time the working thread
  needs. 2 threads ran the 5M-parameter model 10-45x slower than with ``OMP_WAIT_POLICY=PASSIVE``
  (sleep at once); with one busy loop beside it, a short spin (``GOMP_SPINCOUNT=30000``) gave
  0.54x PASSIVE's output tok/s (README "Performance").
- cores that are idle: a thread that sleeps is woken by the kernel at every region, and the
  wake-ups leave a core idle for part of each step. A short spin ran the 64-request workload
  1.51x (5M fp32), 1.14x (125M fp32) and 1.26x (125M bf16) faster than PASSIVE.

So ``PAGEDLLM_OMP_WAIT=auto`` (the default) looks at the machine once, at import: over
``SAMPLE_S`` it reads how busy the CPUs are (``psutil.cpu_times``); when other processes keep less
than ``QUIET_BUSY_CORES`` of a core busy it sets ``GOMP_SPINCOUNT=SPIN_COUNT`` (a short, bounded
spin), otherwise ``OMP_WAIT_POLICY=PASSIVE``. ``PAGEDLLM_OMP_WAIT=spin|passive`` forces one. The
choice holds for the process's life (libgomp reads it once): a server started on an idle machine
that later shares its cores keeps spinning; start it with ``PAGEDLLM_OMP_WAIT=passive`` there.
pagedllm leaves the policy alone when the user chose one (``OMP_WAIT_POLICY`` or
``GOMP_SPINCOUNT`` set) or torch was imported first, when it is too late to change.
``SET_BY_PAGEDLLM`` names the variable it set (the vLLM benchmark backend removes it: vLLM
runs at the user's environment) and ``CHOICE`` says what it chose and why, for the log.
"""

from __future__ import annotations

import os
import sys
import time

from pagedllm import envs

SPIN_COUNT = 30000
QUIET_BUSY_CORES = 0.3
SAMPLE_S = 0.05


def cpu_times() -> tuple[float, float] | None:
    """(busy, total) CPU seconds over all CPUs since boot (psutil); None where it cannot tell."""
    import psutil

    try:
        t = psutil.cpu_times()
    except (OSError, RuntimeError):
        return None
    idle = t.idle + getattr(t, "iowait", 0.0)
    busy = t.user + t.nice + t.system + sum(getattr(t, k, 0.0) for k in ("irq", "softirq", "steal"))
    return busy, busy + idle  # guest time is already counted in user


def busy_cores(sample_s: float = SAMPLE_S) -> float | None:
    """How many cores' worth of CPU the machine spent busy over ``sample_s`` (this process
    sleeps meanwhile, so it is other processes' load); None where the CPU times are unknown."""
    a = cpu_times()
    time.sleep(sample_s)
    b = cpu_times()
    if a is None or b is None or b[1] <= a[1]:
        return None
    return (b[0] - a[0]) / (b[1] - a[1]) * (os.cpu_count() or 1)


def choose(mode: str, busy: float | None) -> tuple[str, str]:
    """(variable=value to set, why) for PAGEDLLM_OMP_WAIT=``mode`` at ``busy`` cores in use."""
    spin, passive = f"GOMP_SPINCOUNT={SPIN_COUNT}", "OMP_WAIT_POLICY=PASSIVE"
    if mode == "spin":
        return spin, "PAGEDLLM_OMP_WAIT=spin"
    if mode == "passive":
        return passive, "PAGEDLLM_OMP_WAIT=passive"
    if mode != "auto":
        raise ValueError(f"PAGEDLLM_OMP_WAIT={mode!r}: use auto, spin or passive")
    if busy is None:
        return passive, "CPU load unknown"
    if busy < QUIET_BUSY_CORES:
        return spin, f"other processes kept {busy:.2f} cores busy at start (idle machine)"
    return passive, f"other processes kept {busy:.2f} cores busy at start (shared machine)"


SET_BY_PAGEDLLM: str | None = None
CHOICE: str | None = None
if ("torch" not in sys.modules and "OMP_WAIT_POLICY" not in os.environ
        and "GOMP_SPINCOUNT" not in os.environ):
    _mode = envs.get("PAGEDLLM_OMP_WAIT") or "auto"
    _setting, _why = choose(_mode, busy_cores() if _mode == "auto" else None)
    SET_BY_PAGEDLLM, _, _value = _setting.partition("=")
    os.environ[SET_BY_PAGEDLLM] = _value
    CHOICE = f"OpenMP threads: {_setting} ({_why}; PAGEDLLM_OMP_WAIT=spin|passive forces one)"


def advice(num_threads: int) -> str | None:
    """A line for the log: what pagedllm chose, or a hint when torch's default (spinning)
    policy is in force with threads."""
    if CHOICE is not None:
        return CHOICE if num_threads >= 2 else None
    if num_threads < 2 or "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return None
    return ("torch was imported before pagedllm, so its OpenMP threads spin between ops; on a "
            "busy machine export OMP_WAIT_POLICY=PASSIVE before starting Python "
            "(see pagedllm/_openmp.py)")
