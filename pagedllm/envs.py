"""pagedllm's environment variables, each declared once: name, type, default, help.

Code reads them through ``get(name)`` (the value, checked, or the default when unset) and
``is_on(name)`` (the on/off switches); ``tests/test_envs.py`` pins that no module reads a
``PAGEDLLM_*`` variable from ``os.environ`` itself and that every one it names is declared here.
The table in the docs (Reference > Environment variables) is generated from ``ENV_VARS``.

Imported before torch loads (``_openmp``, ``_hugepages``): imports nothing heavy.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

OFF = ("0", "off", "false")
ON = ("auto", "1", "on", "true")  # "auto": on where the machine allows it
SWITCH, CHOICE, TEXT = "switch", "choice", "text"


@dataclass(frozen=True)
class EnvVar:
    """``type``: ``switch`` (on: auto/1/on/true, off: 0/off/false), ``choice`` (one of
    ``choices``, case-insensitive) or ``text`` (as given)."""

    name: str
    type: str
    default: str | None
    help: str
    choices: tuple[str, ...] = ()


ENV_VARS = (
    EnvVar("PAGEDLLM_LOG_LEVEL", CHOICE, "info", "level of the pagedllm logger (stderr)",
           ("debug", "info", "warning", "warn", "error", "critical")),
    EnvVar("PAGEDLLM_CPU_KERNELS", SWITCH, "1",
           "0: never build or load the C++ CPU kernels; the pure-torch paths run (what runs "
           "without a compiler)"),
    EnvVar("PAGEDLLM_ISA", CHOICE, "auto",
           "the ISA the C++ kernels are built for: auto = the widest this CPU runs; avx2 on an "
           "AVX-512 machine runs and tests the AVX2 path", ("auto", "avx512", "avx2")),
    EnvVar("PAGEDLLM_CACHE_DIR", TEXT, None,
           "where built kernels are cached (default: $XDG_CACHE_HOME/pagedllm, else "
           "~/.cache/pagedllm)"),
    EnvVar("PAGEDLLM_THP", SWITCH, "auto",
           "transparent huge pages for large CPU tensors (torch's THP_MEM_ALLOC_ENABLE=1) where "
           "the kernel offers them; 0: torch's default"),
    EnvVar("PAGEDLLM_MALLOC", SWITCH, "auto",
           "glibc malloc keeps freed memory for the next step (higher mmap and trim thresholds); "
           "0: glibc's defaults"),
    EnvVar("PAGEDLLM_OMP_WAIT", CHOICE, "auto",
           "what idle OpenMP threads do: auto = spin on an idle machine, sleep "
           "(OMP_WAIT_POLICY=PASSIVE) on a busy one; spin or passive forces one (a user's own "
           "OMP_WAIT_POLICY or GOMP_SPINCOUNT wins)", ("auto", "spin", "passive")),
    EnvVar("PAGEDLLM_API_KEY", TEXT, None,
           "pagedllm serve: the API key when --api-key is not given"),
    EnvVar("PAGEDLLM_LOG_STATS_INTERVAL", TEXT, None,
           "pagedllm serve: seconds between two periodic stats lines (default 10; vLLM's "
           "VLLM_LOG_STATS_INTERVAL)"),
    EnvVar("PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING", SWITCH, "0",
           "pagedllm serve: 1 serves /v1/load_lora_adapter and /v1/unload_lora_adapter as "
           "--allow-runtime-lora-updating does (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)"),
    EnvVar("PAGEDLLM_VLLM_PYTHON", TEXT, None,
           "bench throughput / serve: the Python of a venv with vLLM when --vllm-python is not "
           "given"),
)
_BY_NAME = {v.name: v for v in ENV_VARS}


def get(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """``name``'s value in ``env`` (default: ``os.environ``), or its default when unset or
    empty; switches and choices lower-cased and checked (a ValueError naming the variable and
    its values). A KeyError for a name not in ``ENV_VARS``: declare it there first."""
    var = _BY_NAME[name]
    value = (os.environ if env is None else env).get(name)
    if value is None or not value.strip():
        return var.default
    if var.type == TEXT:
        return value
    value = value.strip().lower()
    if var.type == SWITCH:
        auto_or_off(name, value)  # raises for anything else
    elif value not in var.choices:
        raise ValueError(f"{name}={value!r}: use {', '.join(var.choices[:-1])} or "
                         f"{var.choices[-1]}")
    return value


def is_on(name: str, env: Mapping[str, str] | None = None) -> bool:
    """A switch's state (``get`` checked the value)."""
    return auto_or_off(name, get(name, env) or "")


def auto_or_off(var: str, setting: str) -> bool:
    """True for ``var=auto`` (or 1/on/true), False for ``var=0`` (or off/false); a ValueError
    naming ``var`` for anything else. ``setting`` is already stripped and lower-cased."""
    if setting in OFF:
        return False
    if setting in ON:
        return True
    raise ValueError(f"{var}={setting!r}: use auto or 0")
