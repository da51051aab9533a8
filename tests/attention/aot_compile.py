"""Ahead-of-time compilation of the Triton kernels for a GPU target, no GPU needed (Triton ships
``ptxas``): the interpreter checks the kernels' semantics, this checks GPU code generation and the
shared-memory budget. Each test passes the body of a script that calls ``compile_for``; it runs
in a subprocess without TRITON_INTERPRET (triton picks the interpreter at import time)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_PRELUDE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagedllm.attention.triton import decode, kv_write, prefill

def compile_for(kernel, ptrs, consts, arch, floats=("scale_log2",)):
    defaults = {p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default}
    consts = {**defaults, **consts}
    sig = {}
    for name in kernel.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = ptrs.get(name, "*i32")
        else:
            sig[name] = "fp32" if name in floats else "i32"
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts)
    c = triton.compile(src, target=GPUTarget("cuda", arch, 32))
    limit = 232448 if arch >= 90 else 166912
    assert c.metadata.shared <= limit, (kernel, consts, c.metadata.shared)
"""


def compile_kernels(body: str) -> None:
    """Run ``body`` (which calls ``compile_for``) after the prelude; it must print "compiled"."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", _PRELUDE + body], env=env, capture_output=True,
                         text=True, timeout=900)
    if res.returncode != 0 and "ptxas" in res.stderr and "not found" in res.stderr.lower():
        pytest.skip(f"no ptxas to compile with: {res.stderr[-300:]}")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "compiled" in res.stdout
