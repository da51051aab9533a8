"""pagedllm/_malloc.py: on CPU, glibc keeps the memory a step frees for the next step (no fresh
pages, no page faults, for every large activation); PAGEDLLM_MALLOC=0 and a user's own malloc
settings win."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagedllm import _malloc

pytestmark = pytest.mark.skipif(_malloc.glibc() is None, reason="mallopt is glibc's")


def test_choose() -> None:
    assert _malloc.choose("auto", {}, True)[0]
    assert _malloc.choose("1", {}, True)[0]
    assert _malloc.choose("auto", {}, False) == (False, "not glibc")
    assert _malloc.choose("0", {}, True) == (False, "PAGEDLLM_MALLOC=0")
    for var in ("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES", "LD_PRELOAD"):
        on, why = _malloc.choose("auto", {var: "x"}, True)
        assert not on and why == f"{var} set by the user"
    assert _malloc.choose("auto", {"LD_PRELOAD": ""}, True)[0]  # empty: nothing preloaded
    with pytest.raises(ValueError, match="PAGEDLLM_MALLOC='yes'"):
        _malloc.choose("yes", {}, True)


# ``setup``, then allocate, fill and free a 64 MiB tensor 8 times (4 KiB pages, so that every
# fresh page is a fault); print the line keep_freed_memory logs and the minor faults of the loop.
# The first rounds warm the heap: torch asks for 64-byte aligned blocks, which a freed block of
# the same size cannot serve until it has merged with its neighbours (4 rounds here).
LOOP = """
import resource, sys, torch
from pagedllm import _malloc
exec(sys.argv[1])
for _ in range(8):
    x = torch.ones(1 << 24); del x
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):
    x = torch.ones(1 << 24); del x
print(_malloc.keep_freed_memory())
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""
FRESH = 8 * 16384 * 0.9  # faults when every 64 MiB is mapped afresh


def _faults(setup: str = "_malloc.keep_freed_memory()", **env: str) -> tuple[str, int]:
    base = {k: v for k, v in os.environ.items()
            if k not in (*_malloc.USER_VARS, "PAGEDLLM_MALLOC", "THP_MEM_ALLOC_ENABLE")}
    out = subprocess.run([sys.executable, "-c", LOOP, setup], capture_output=True, text=True,
                         env={**base, "PAGEDLLM_THP": "0", **env}, check=True).stdout.splitlines()
    return out[-2], int(out[-1])


def test_a_cpu_engine_keeps_freed_memory_so_large_blocks_fault_no_more() -> None:
    from pagedllm.config import default_model_path

    engine = (f"from pagedllm import LLM; "  # applied once the engine allocated its KV pool
              f"LLM({str(default_model_path())!r}, max_model_len=128, kv_cache_memory='8MiB')")
    on_line, on = _faults(engine)
    assert "on (mmap threshold 256 MiB" in on_line
    assert on < 200, f"freed blocks should be reused from the heap: {on} faults"
    off_line, off = _faults(PAGEDLLM_MALLOC="0")
    assert off_line.endswith("off (PAGEDLLM_MALLOC=0)")
    assert off >= FRESH, f"glibc's default maps each 64 MiB afresh: {off} faults"
    user_line, user = _faults(MALLOC_TRIM_THRESHOLD_="131072")
    assert "MALLOC_TRIM_THRESHOLD_ set by the user" in user_line and user >= FRESH
