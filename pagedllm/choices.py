"""Every closed list of names a setting takes, written once: the flags' ``choices``, the frozen
configs' checks and their error messages all read these (``tests/test_choices.py`` holds each
list to the code that implements it). Imports nothing.
"""

from __future__ import annotations

# Model dtypes (``--dtype``): the three computed in, and the spellings accepted for them.
SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")
DTYPE_ALIASES = {
    "float": "float32",
    "fp32": "float32",
    "float32": "float32",
    "half": "float16",
    "fp16": "float16",
    "float16": "float16",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
}
DTYPE_NAMES = ("auto", *DTYPE_ALIASES)  # what ``dtype`` / ``--dtype`` accept

# KV cache storage dtypes (``--kv-cache-dtype``, vLLM's names): "auto" stores K/V at the model
# dtype; the others store 1-byte values plus one bf16 scale per token and KV head
# (pagedllm/attention/quant.py). "fp8" means fp8_e4m3, as in vLLM.
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3"}
KV_CACHE_DTYPE_NAMES = (*KV_CACHE_DTYPES, *KV_CACHE_DTYPE_ALIASES)

# The built-in attention backends (attention/registry.py; more may register at run time).
ATTENTION_BACKENDS = ("torch_ref", "cpu", "triton")
LINEAR_BACKENDS = ("auto", "gemm", "onednn", "torch")  # CPU linear layers (layers/linear.py)
PREEMPTION_MODES = ("recompute", "swap", "auto")  # what a preempted request loses
EXECUTOR_BACKENDS = ("mp", "ray")  # where tensor-parallel ranks 1..N-1 run
TOOL_CALL_PARSERS = ("hermes", "llama3_json")  # server/tools.py
