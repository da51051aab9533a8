"""The CPU's model name and feature flags (/proc/cpuinfo: psutil does not give them), for the
kernels' ISA choice and the machine a benchmark or a planner profile ran on. Imports nothing
heavy (the planner runs without torch)."""

from __future__ import annotations

import os
import platform


def _cpuinfo() -> dict[str, str]:
    """The first processor's "model name" and "flags" lines of /proc/cpuinfo ({} without it)."""
    out: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "flags") and key.strip() not in out:
                    out[key.strip()] = value.strip()
    except OSError:
        pass
    return out


def cpu_model() -> str:
    return _cpuinfo().get("model name", platform.processor() or platform.machine())


def cpu_flags() -> frozenset[str]:
    return frozenset(_cpuinfo().get("flags", "").split())


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask: a container's cpuset counts)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def serving_threads(replicas: int = 1) -> int | None:
    """Torch threads for each of ``replicas`` engine cores behind a server: one core is left to
    the API process (HTTP, detokenizing, streaming), as vLLM's CPU backend reserves one; None
    (torch's default) when the user set ``OMP_NUM_THREADS``."""
    if "OMP_NUM_THREADS" in os.environ:
        return None
    return max(1, (usable_cores() - 1) // replicas)
