"""pagedllm/_openmp.py: the OpenMP wait policy chosen at import (spin on an idle machine,
PASSIVE on a shared one, the user's choice left alone)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagedllm import _openmp


def test_auto_spins_only_when_the_machine_is_idle() -> None:
    assert _openmp.choose("auto", 0.05)[0] == f"GOMP_SPINCOUNT={_openmp.SPIN_COUNT}"
    assert _openmp.choose("auto", _openmp.QUIET_BUSY_CORES)[0] == "OMP_WAIT_POLICY=PASSIVE"
    assert _openmp.choose("auto", 1.7)[0] == "OMP_WAIT_POLICY=PASSIVE"
    assert _openmp.choose("auto", None)[0] == "OMP_WAIT_POLICY=PASSIVE"
    assert _openmp.choose("spin", 1.7)[0].startswith("GOMP_SPINCOUNT=")
    assert _openmp.choose("passive", 0.0)[0] == "OMP_WAIT_POLICY=PASSIVE"
    with pytest.raises(ValueError, match="PAGEDLLM_OMP_WAIT='fast'"):
        _openmp.choose("fast", 0.0)


def test_busy_cores_sees_a_busy_loop() -> None:
    idle = _openmp.busy_cores(0.2)
    if idle is None:
        pytest.skip("the CPU times are unknown on this system")
    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        busy = _openmp.busy_cores(0.5)
    finally:
        loop.kill()
        loop.wait()
    assert busy is not None and 0.0 <= idle <= (os.cpu_count() or 1)
    assert busy >= 0.7, busy  # the loop alone keeps one core busy


def _env_after_import(**env: str) -> tuple[str, str]:
    base = {k: v for k, v in os.environ.items()
            if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "PAGEDLLM_OMP_WAIT")}
    out = subprocess.run(
        [sys.executable, "-c", "import os, pagedllm; print(os.environ.get('OMP_WAIT_POLICY'), "
         "os.environ.get('GOMP_SPINCOUNT'))"],
        env={**base, **env}, capture_output=True, text=True, check=True).stdout.split()
    return out[0], out[1]


def test_import_sets_the_forced_policy_and_leaves_the_users_alone() -> None:
    assert _env_after_import(PAGEDLLM_OMP_WAIT="spin") == ("None", str(_openmp.SPIN_COUNT))
    assert _env_after_import(PAGEDLLM_OMP_WAIT="passive") == ("PASSIVE", "None")
    assert _env_after_import(OMP_WAIT_POLICY="ACTIVE") == ("ACTIVE", "None")
    assert _env_after_import(GOMP_SPINCOUNT="7", PAGEDLLM_OMP_WAIT="passive") == ("None", "7")
