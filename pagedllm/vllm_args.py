"""vLLM settings pagedllm has no field for: one table for ``LLM(...)`` / ``EngineArgs.from_kwargs``
and for ``pagedllm serve``'s flags (server/vllm_flags.py), so a vLLM script or command line runs
unchanged and is never silently half-honoured.

A setting is *harmless* (it changes nothing a caller sees here: accepted, with one warning line
saying why) or *refused* unless at a neutral value (it would change the model or its outputs in
a way pagedllm does not implement: a ValueError saying what to do instead). A neutral value (the
setting's vLLM default, or one that asks for what pagedllm does anyway) passes quietly.
Settings pagedllm honours are fields of ``EngineArgs`` (``trust_remote_code``, ``revision``,
``download_dir``, ``hf_overrides``, ``max_logprobs``, ``seed``, ``swap_space``, ...), not here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class VllmSetting:
    why: str  # harmless: why it has no effect here; refused: what to do instead
    refused: bool = False  # a non-neutral value is a ValueError (else a warning)
    neutral: tuple[Any, ...] = (None, False)  # values that ask for nothing: accepted quietly
    takes_value: bool = False  # as a serve flag: takes a value (else a store_true switch)
    api: bool = True  # a keyword of LLM(...) / EngineArgs
    cli: bool = True  # a flag of pagedllm serve


def _refused(why: str, *neutral: Any, api: bool = True) -> VllmSetting:
    return VllmSetting(why, True, (None, *neutral), takes_value=bool(neutral), api=api)


def _server(why: str) -> VllmSetting:
    return VllmSetting(why, api=False)


VLLM_SETTINGS: dict[str, VllmSetting] = {
    # harmless
    "disable_log_stats": VllmSetting("LLM logs no periodic stats line (pagedllm serve does: "
                                     "its --disable-log-stats)", cli=False),
    "disable_custom_all_reduce": VllmSetting(
        "tensor parallelism all-reduces through torch.distributed"),
    "disable_async_output_proc": VllmSetting("outputs are detokenized after each step"),
    "use_v2_block_manager": VllmSetting("pagedllm has one KV block manager"),
    "max_seq_len_to_capture": VllmSetting(
        "CUDA graphs are captured per decode batch size, for any length", takes_value=True),
    "compilation_config": VllmSetting(
        "pagedllm does not torch.compile the model (CUDA graphs: enforce_eager)",
        neutral=(None, 0, "0", {}), takes_value=True),
    "calculate_kv_scales": VllmSetting(
        "a quantized KV cache computes a scale per token and KV head as it writes"),
    "limit_mm_per_prompt": VllmSetting("pagedllm runs text-only models", takes_value=True),
    "mm_processor_kwargs": VllmSetting("pagedllm runs text-only models", takes_value=True),
    "scheduling_policy": VllmSetting(
        "requests run by priority (lower first), then arrival: FCFS when none is given",
        neutral=(None, "fcfs", "priority"), takes_value=True),
    "served_model_name": VllmSetting("the name is the server's (pagedllm serve "
                                     "--served-model-name)", takes_value=True, cli=False),
    "disable_log_requests": _server("requests are logged only with --enable-log-requests"),
    "enable_auto_tool_choice": _server("tool_choice 'auto' is on whenever --tool-call-parser "
                                       "is set"),
    "disable_frontend_multiprocessing": _server("the API server and the engine share one process"),
    "disable_uvicorn_access_log": _server("use --uvicorn-log-level warning"),
    # refused but at a neutral value
    "quantization": _refused("pagedllm loads unquantized weights only (KV cache: kv_cache_dtype)"),
    "load_format": _refused("pagedllm reads safetensors checkpoints only", "auto", "safetensors"),
    "tokenizer_mode": _refused("pagedllm loads the checkpoint's tokenizer as AutoTokenizer does",
                               "auto", "hf"),
    "config_format": _refused("pagedllm reads Hugging Face config.json only", "auto", "hf"),
    "pipeline_parallel_size": _refused("use tensor_parallel_size", 1),
    "data_parallel_size": VllmSetting(  # serve's own flag (--data-parallel-size)
        "LLM runs one engine; pagedllm serve --data-parallel-size N runs N replicas behind one "
        "server", True, (None, 1), takes_value=True, cli=False),
    "cpu_offload_gb": _refused("weights stay on one device; swap_space moves KV to the host", 0),
    "task": _refused("pagedllm generates text only (no embedding or pooling models)",
                     "auto", "generate"),
    "runner": _refused("pagedllm generates text only (no embedding or pooling models)",
                       "auto", "generate"),
    "logprobs_mode": _refused("logprobs are always raw (before penalties and temperature)",
                              "raw_logprobs"),
    "override_generation_config": _refused(
        "set the sampling defaults with generation_config=DIR or SamplingParams", {}),
    "disable_sliding_window": VllmSetting(
        "a model with a window attends within it (docs/features/sliding-window.md)", True),
    "skip_tokenizer_init": VllmSetting(
        "the engine needs the tokenizer (stop strings, detokenizing)", True),
}
# serve flags that take a value but are refused at any value given
_VALUED = frozenset({"quantization"})


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def takes_value(name: str) -> bool:
    return VLLM_SETTINGS[name].takes_value or name in _VALUED


def check(name: str, value: Any, spelled: str, where: str) -> str | None:
    """``value`` for the vLLM setting ``name``: None when neutral, else the warning line for a
    harmless setting; a ValueError for a refused one. ``spelled``: the setting as the user wrote
    it (``--quantization`` or ``quantization='awq'``); ``where``: the caller (``LLM``)."""
    s = VLLM_SETTINGS[name]
    if value in s.neutral or str(value) in {str(n) for n in s.neutral if n is not None}:
        return None
    if s.refused:
        raise ValueError(f"{spelled} is not supported by {where}: {s.why}")
    return f"{spelled} has no effect here ({s.why})"


def cpu_no_effect(device: str, gpu_memory_utilization: float, enforce_eager: bool) -> list[str]:
    """Warnings for CUDA-only settings given away from their defaults on the CPU."""
    from pagedllm.config import EngineConfig

    if device != "cpu":
        return []
    out = []
    if gpu_memory_utilization != EngineConfig.gpu_memory_utilization:
        out.append(f"gpu_memory_utilization={gpu_memory_utilization} has no effect on the CPU "
                   "(the KV pool is sized by kv_cache_memory or num_kv_blocks)")
    if enforce_eager:
        out.append("enforce_eager=True has no effect on the CPU (it runs every step eagerly)")
    return out
