"""Import this first in a test of Triton kernels: it sets TRITON_INTERPRET=1 unless the
environment says otherwise (it must be set before triton is first imported: ``@triton.jit``
picks the interpreter at decoration time), skips the module without triton, or without both
the interpreter and a GPU, and names the device the kernels take tensors on (``DEVICE``: CPU
tensors in the interpreter, CUDA ones compiled)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install 'pagedllm[cuda]')")

from pagedllm.attention.triton import common  # noqa: E402

if not common.INTERPRET and not torch.cuda.is_available():
    pytest.skip("triton was imported without TRITON_INTERPRET=1 and there is no GPU",
                allow_module_level=True)
DEVICE = "cpu" if common.INTERPRET else "cuda"
