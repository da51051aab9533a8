"""PAGEDLLM_ISA: which ISA the CPU kernels are built for (kernels.choose_isa), its errors, and the
kernel tests run again on the AVX2 build where this CPU also runs AVX-512 (the override's point:
an AVX-512 machine tests the code an AVX2-only CPU runs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm import kernels

AVX512 = frozenset({"avx512f", "avx2", "fma", "f16c", "sse4_2"})
AVX2 = frozenset({"avx2", "fma", "f16c", "sse4_2"})
OLD = frozenset({"sse4_2"})


@pytest.mark.parametrize("setting,flags,want", [
    ("auto", AVX512, "avx512"), ("", AVX512, "avx512"), ("AVX2", AVX512, "avx2"),
    ("avx512", AVX512, "avx512"), ("auto", AVX2, "avx2"), ("avx2", AVX2, "avx2"),
    ("auto", OLD, "generic"),
])
def test_choose_isa(setting: str, flags: frozenset[str], want: str) -> None:
    assert kernels.choose_isa(setting, flags) == want


def test_choose_isa_refuses_what_the_cpu_cannot_run() -> None:
    with pytest.raises(ValueError, match=r"PAGEDLLM_ISA=avx512: .* lacks avx512f; .* set it to avx2"):
        kernels.choose_isa("avx512", AVX2)
    with pytest.raises(ValueError, match=r"PAGEDLLM_ISA=avx2: .* lacks avx2, fma, f16c; unset"):
        kernels.choose_isa("avx2", OLD)
    with pytest.raises(ValueError, match=r"PAGEDLLM_ISA='sse': use auto, avx512 or avx2"):
        kernels.choose_isa("sse", AVX512)
    with pytest.raises(ValueError, match="use auto, avx512 or avx2"):
        kernels.choose_isa("generic", AVX512)


def test_each_isa_has_its_own_build(monkeypatch: pytest.MonkeyPatch) -> None:
    if not {"avx512f", "avx2", "fma", "f16c"} <= kernels.cpu_flags():
        pytest.skip("this CPU runs one of the ISAs only")
    keys = {}
    for isa in ("avx512", "avx2"):
        monkeypatch.setenv("PAGEDLLM_ISA", isa)
        keys[isa] = (kernels._key(), kernels._flags())
    assert keys["avx512"][0] != keys["avx2"][0]
    assert "-march=haswell" in keys["avx2"][1] and "-march=native" in keys["avx512"][1]


@pytest.mark.slow
def test_kernel_tests_pass_on_the_avx2_build() -> None:
    """The GEMM and attention-kernel tests and the golden greedy-vs-HF tests (float32: identical
    tokens, logprobs within 1e-4), in a process that builds (or loads) the AVX2 kernels."""
    if "avx512f" not in kernels.cpu_flags() or not {"avx2", "fma", "f16c"} <= kernels.cpu_flags():
        pytest.skip("needs a CPU that runs both AVX-512 and AVX2 (else the default run is AVX2)")
    if os.environ.get("PAGEDLLM_CPU_KERNELS") == "0":
        pytest.skip("CPU kernels switched off by PAGEDLLM_CPU_KERNELS=0")
    tests = Path(__file__).parents[1]
    files = [tests / "layers" / "test_gemm.py", tests / "layers" / "test_linear.py",
             tests / "attention" / "test_cpu_kernel.py", tests / "layers" / "test_fused_ops.py",
             tests / "golden" / "test_engine_vs_hf.py", tests / "layers" / "test_w16_engine.py"]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        "-m", "not slow", *map(str, files)],
                       env={**os.environ, "PAGEDLLM_ISA": "avx2"}, capture_output=True, text=True,
                       timeout=1500)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
