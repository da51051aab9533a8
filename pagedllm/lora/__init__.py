"""Multi-LoRA serving: adapters on one base model (issue 29).

Pure-Python parts (importable by sched/ and kv/): ``LoRARequest``, ``LoRAConfig``. The torch
parts -- ``adapter`` (load and check a PEFT adapter), ``ops`` (the batched mixed-adapter delta)
and ``manager`` (GPU slots + CPU LRU cache, the per-step mapping) -- are imported by the runner.
"""

from pagedllm.lora.request import LoRAConfig, LoRARequest, lora_extra_keys

__all__ = ["LoRAConfig", "LoRARequest", "lora_extra_keys"]
