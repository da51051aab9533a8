"""EngineArgs: every engine setting once — name, type, default, help.

The same fields make the flags of ``pagedllm generate | serve | bench | plan`` (``add_cli_args``),
the keyword arguments of ``LLM(...)`` / ``LLMEngine.from_args(...)`` (``from_kwargs``), the keys of
a YAML ``--config`` file, and the frozen configs (``create_engine_config``). Defaults that the
frozen configs also carry are read from them, so each is written in one place.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from functools import partial
from typing import Any

from pagedllm.choices import (
    ATTENTION_BACKENDS,
    DTYPE_NAMES,
    EXECUTOR_BACKENDS,
    KV_CACHE_DTYPE_NAMES,
    LINEAR_BACKENDS,
    PREEMPTION_MODES,
)
from pagedllm.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    default_model_path,
    normalize_kv_cache_dtype,
    parse_memory,
)
from pagedllm.flags import add_flags, check_names, from_namespace, setting
from pagedllm.hub import resolve_model
from pagedllm.kv.ext_tier import KVTransferConfig
from pagedllm.logging_utils import init_logger
from pagedllm.lora.request import LoRAConfig
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.vllm_args import VLLM_SETTINGS, check, cpu_no_effect

logger = init_logger(__name__)

ENGINE, MEMORY, LORA = "engine", "memory", "lora"
GROUP_TITLES = {ENGINE: "engine (names follow vLLM)", MEMORY: "KV memory management",
                LORA: "LoRA adapters (names follow vLLM)"}
_C, _S, _P, _E, _L = CacheConfig, SchedulerConfig, ParallelConfig, EngineConfig, LoRAConfig


@dataclass
class EngineArgs:
    """Engine settings as a user gives them (``LLM(**kwargs)``, flags, YAML); see
    ``create_engine_config`` for how they become the frozen configs."""

    model: str | None = setting(
        None, "HF checkpoint directory (default: the shipped model)", metavar="DIR")
    tokenizer: str | None = setting(
        None, "tokenizer directory (default: --model)", metavar="DIR")
    trust_remote_code: bool = setting(
        False, "let a checkpoint's own config and tokenizer code (auto_map) run, as "
        "transformers' trust_remote_code; the model code is always pagedllm's")
    revision: str | None = setting(
        None, "branch, tag or commit of a model given by Hugging Face id", metavar="REV")
    tokenizer_revision: str | None = setting(
        None, "the same for a tokenizer given by id (default: --revision)", metavar="REV")
    download_dir: str | None = setting(
        None, "Hugging Face cache to find and download models given by id in (default: "
        "HF_HUB_CACHE)", metavar="DIR")
    hf_overrides: str | dict[str, Any] | None = setting(
        None, "config.json keys to override before it is read, JSON: "
        "{\"max_position_embeddings\": 8192}", metavar="JSON")
    max_logprobs: int = setting(
        _E.max_logprobs, "largest logprobs / prompt_logprobs a request may ask for (-1: the "
        "vocabulary)")
    dtype: str = setting("auto", "model dtype; auto = the checkpoint's", choices=DTYPE_NAMES)
    generation_config: str = setting(
        "auto", "default sampling settings: auto = the model's generation_config.json "
        "(temperature, top_p, top_k, min_p, repetition_penalty, eos ids) for what a request does "
        "not set, vllm = none, or a directory holding the file", metavar="auto|vllm|DIR")
    block_size: int = setting(_C.block_size, "tokens per KV block (power of two, 1..512)")
    kv_cache_memory: str | int | None = setting(
        None, "KV pool budget, e.g. 2GiB or bytes (default: fits --max-num-seqs full requests, "
        "<= 4GiB)", "--kv-cache-memory-bytes", metavar="SIZE")
    num_kv_blocks: int | None = setting(
        None, "exact number of KV blocks (overrides --kv-cache-memory)", "--num-gpu-blocks-override")
    max_num_seqs: int = setting(_S.max_num_seqs, "most requests running in one step")
    max_num_batched_tokens: int | None = setting(
        None, "token budget of one step (default: max(2048, max_num_seqs) with chunked prefill, "
        "else max(max_model_len, 2048))")
    max_model_len: int | None = setting(
        None, "longest prompt + output (default: the model's max_position_embeddings)")
    enable_prefix_caching: bool = setting(_C.enable_prefix_caching, "reuse cached prompt blocks")
    enable_chunked_prefill: bool = setting(
        _S.enable_chunked_prefill, "split long prompts over steps (off: a prompt fits one step)")
    kv_cache_dtype: str = setting(
        _C.k_cache_dtype, "KV cache storage: auto = the model dtype; int8 / fp8 (= fp8_e4m3): one "
        "byte per value and a scale per token and KV head", choices=KV_CACHE_DTYPE_NAMES)
    k_cache_dtype: str | None = setting(None, "override --kv-cache-dtype for K",
                                        choices=KV_CACHE_DTYPE_NAMES)
    v_cache_dtype: str | None = setting(None, "override --kv-cache-dtype for V",
                                        choices=KV_CACHE_DTYPE_NAMES)
    seed: int = setting(_E.seed, "random seed")
    device: str = setting(_E.device, "cpu | cuda | cuda:N")
    attention_backend: str | None = setting(
        _E.attention_backend, f"{' | '.join(ATTENTION_BACKENDS)} (default: cpu on CPU, triton "
        "on CUDA)")
    gpu_memory_utilization: float = setting(
        _E.gpu_memory_utilization, "CUDA: fraction of GPU memory for weights + activations + KV "
        "pool, when --kv-cache-memory / --num-kv-blocks are not given")
    enforce_eager: bool = setting(_E.enforce_eager, "CUDA: no CUDA graphs; every step runs eagerly")
    linear_backend: str = setting(
        _E.linear_backend, "CPU: auto = linear layers on weights packed at load (float32: "
        "pagedllm's GEMM where it runs, else oneDNN), gemm = pagedllm's GEMM only (float32; "
        "bfloat16 with AVX512-BF16), onednn = oneDNN only, torch = F.linear",
        choices=LINEAR_BACKENDS)
    fused_ops: bool = setting(
        _E.fused_ops, "CPU: RMSNorm (+ residual add), rotary and SiLU-and-mul as fused C++ ops "
        "(when the kernels build); --no-fused-ops runs the torch ops")
    fused_layers: bool = setting(
        _E.fused_layers, "CPU, with --fused-ops: each decoder layer as two C++ ops around its "
        "attention; --no-fused-layers calls its modules one by one")
    batch_invariant: bool = setting(
        _E.batch_invariant, "a request's tokens and logprobs have the same bits whatever "
        "else is in the batch (its neighbours, prefill chunking, prefix-cache hits, preemption): "
        "on CPU every linear on pagedllm's GEMM, attention on a fixed tile grid; with the triton "
        "attention backend (CUDA; not yet measured on a GPU) Triton GEMM, norm and softmax "
        "kernels with one tile for every batch, every token through the fixed-split decode "
        "kernel; a generator per sampled request")
    tensor_parallel_size: int = setting(
        _P.tensor_parallel_size, "shard the model over N ranks (worker processes; CPU/gloo)", "-tp")
    distributed_executor_backend: str = setting(
        _P.distributed_executor_backend,
        "where ranks 1..N-1 run: mp = local worker processes, ray = Ray actors",
        choices=EXECUTOR_BACKENDS)
    swap_space: float = setting(0.0, "GiB of host memory for swapped-out KV blocks", group=MEMORY)
    preemption_mode: str = setting(_S.preemption_mode, "what a preempted request loses",
                                   choices=PREEMPTION_MODES, group=MEMORY)
    reserved_fraction: float = setting(
        _S.reserved_fraction, "share of blocks only the urgent class may take", group=MEMORY)
    urgent_priority: int = setting(
        _S.urgent_priority, "priority <= this is the urgent class", group=MEMORY)
    initial_num_kv_blocks: int | None = setting(
        _C.initial_num_kv_blocks, "start the pool smaller and grow it (elastic pool)", group=MEMORY)
    grow_chunk: int = setting(_C.grow_chunk, "blocks an elastic pool grows by", group=MEMORY)
    compact_every_n_steps: int | None = setting(
        _C.compact_every_n_steps, "defragment every N steps", group=MEMORY)
    compact_below_utilization: float | None = setting(
        _C.compact_below_utilization, "defragment when KV utilization stays below this",
        group=MEMORY)
    compact_window_steps: int = setting(
        _C.compact_window_steps, "steps utilization must stay low before compacting",
        group=MEMORY)
    kv_trace_path: str | None = setting(
        _C.kv_trace_path, "write the KV allocation event trace (JSONL, replayable) to this file",
        "--kv-trace", group=MEMORY, metavar="FILE")
    kv_events_endpoint: str | None = setting(
        _C.kv_events_endpoint, "publish the KV cache events (stored / removed / cleared, one "
        "msgpack batch per step) on a ZMQ PUB socket bound here, e.g. tcp://127.0.0.1:5557",
        group=MEMORY, metavar="ENDPOINT")
    kv_transfer_config: str | dict[str, Any] | None = setting(
        None, "a KV tier shared by replicas, vLLM's JSON shape: {\"kv_connector\": \"ray\", "
        "\"kv_role\": \"kv_both\"} (ray: a named Ray actor; inproc: this process only); "
        "optional \"kv_buffer_size\" (bytes, default 1 GiB) and \"kv_connector_extra_config\": "
        "{\"actor_name\": ...}", group=MEMORY, metavar="JSON")
    free_window_blocks: bool = setting(
        _C.free_window_blocks, "sliding-window models: return KV blocks that leave the window to "
        "the pool (off: keep every block, as a full-attention model does)", group=MEMORY)
    speculative_config: str | dict[str, Any] | None = setting(
        None, "speculative decoding, JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
        "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 1} or {\"model\": DRAFT_DIR, "
        "\"num_speculative_tokens\": 4} (default: off)", metavar="JSON")
    enable_lora: bool = setting(
        False, "serve LoRA adapters: generate(..., lora_request=LoRARequest(...))", group=LORA)
    max_loras: int = setting(_L.max_loras, "most distinct LoRA adapters in one step (device slots)",
                             group=LORA)
    max_lora_rank: int = setting(_L.max_lora_rank, "largest LoRA rank an adapter may have",
                                 group=LORA)
    max_cpu_loras: int | None = setting(
        _L.max_cpu_loras, "LoRA adapters kept loaded on the host, LRU (default: --max-loras)",
        group=LORA)
    preheat_prompts: Sequence[Any] | str | None = setting(
        None, "file of prompts (one per line, text or a JSON list of ids) to cache at start-up",
        group=MEMORY, metavar="FILE")

    @classmethod
    def aliases(cls) -> dict[str, str]:
        """vLLM's keyword names -> field names (``kv_cache_memory_bytes`` -> ``kv_cache_memory``)."""
        return {a.lstrip("-").replace("-", "_"): f.name for f in fields(cls)
                for a in f.metadata.get("aliases", ()) if a.startswith("--")}

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any], what: str = "EngineArgs") -> EngineArgs:
        """Keyword arguments -> EngineArgs, accepting vLLM's names; vLLM settings pagedllm has
        no field for (``pagedllm.vllm_args``) are accepted with a warning, or refused (ValueError)
        where they would change outputs. An unknown name is a TypeError naming the closest
        field (``what`` names the caller in the messages)."""
        aliases = cls.aliases()
        vllm = {n for n, s in VLLM_SETTINGS.items() if s.api}
        check_names(cls, list(kwargs), {**aliases, **{n: n for n in vllm}}, what)
        warnings = [check(k, v, f"{k}={v!r}", what) for k, v in kwargs.items() if k in vllm]
        args = cls(**{aliases.get(k, k): v for k, v in kwargs.items() if k not in vllm})
        warnings += cpu_no_effect(args.device, args.gpu_memory_utilization, args.enforce_eager)
        for line in warnings:
            if line is not None:
                logger.warning("%s", line)
        return args

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, only: Collection[str] | None = None) -> None:
        """Every field as a flag, plus ``--config FILE.yaml``; ``only``: just those fields' flags
        (a command that uses a few engine settings takes them from here, never re-declared)."""
        add_flags(parser, EngineArgs, GROUP_TITLES, only)
        if only is not None:
            return
        parser.add_argument("--config", default=None, metavar="FILE",
                            help="YAML file of flag values (keys: flag names, dashes or "
                            "underscores); the command line wins over the file, the file over "
                            "the defaults")

    @classmethod
    def from_cli(cls, ns: argparse.Namespace) -> EngineArgs:
        return from_namespace(cls, ns)

    def create_engine_config(self) -> EngineConfig:
        """The frozen configs. Raises ValueError naming the setting at fault."""
        hub = partial(resolve_model, cache_dir=self.download_dir)
        model = hub(self.model, revision=self.revision) if self.model else default_model_path()
        mcfg = ModelConfig.from_hf(model, self.dtype, self.trust_remote_code, self._hf_overrides())
        if (self.device == "cpu" and self.linear_backend in ("auto", "gemm")
                and self.attention_backend != "triton"):  # the Triton family has its own GEMM
            from pagedllm.layers.linear import w16_dtype

            if (w16 := w16_dtype(mcfg.dtype, self.device)) is not None:  # 16-bit weights, fp32 math
                mcfg = replace(mcfg, dtype="float32", weight_dtype=w16)
        limit = mcfg.max_position_embeddings
        max_model_len = self.max_model_len
        if max_model_len is None:
            max_model_len = limit
        elif max_model_len > limit:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                f"{limit}; lower --max-model-len"
            )
        budget = self.max_num_batched_tokens
        if budget is None:
            floor = _S.max_num_batched_tokens
            budget = (max(floor, self.max_num_seqs) if self.enable_chunked_prefill
                      else max(max_model_len, floor))
        memory = self.kv_cache_memory
        lora = self._lora_config()
        return EngineConfig(
            model=mcfg,
            cache=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory=parse_memory(memory) if memory is not None else None,
                num_kv_blocks=self.num_kv_blocks,
                enable_prefix_caching=self.enable_prefix_caching,
                swap_space=int(self.swap_space * 1024**3),  # GiB, as vLLM's --swap-space
                initial_num_kv_blocks=self.initial_num_kv_blocks,
                grow_chunk=self.grow_chunk,
                compact_every_n_steps=self.compact_every_n_steps,
                compact_below_utilization=self.compact_below_utilization,
                compact_window_steps=self.compact_window_steps,
                k_cache_dtype=self._kv_dtype("k_cache_dtype", self.k_cache_dtype),
                v_cache_dtype=self._kv_dtype("v_cache_dtype", self.v_cache_dtype),
                kv_trace_path=self.kv_trace_path,
                kv_events_endpoint=self.kv_events_endpoint,
                free_window_blocks=self.free_window_blocks,
                kv_transfer=(None if self.kv_transfer_config is None
                             else KVTransferConfig.parse(self.kv_transfer_config)),
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=budget,
                max_model_len=max_model_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
                reserved_fraction=self.reserved_fraction,
                urgent_priority=self.urgent_priority,
                preemption_mode=self.preemption_mode,
                max_loras=None if lora is None else lora.max_loras,
            ),
            tokenizer=(hub(self.tokenizer, "tokenizer", self.tokenizer_revision or self.revision)
                       if self.tokenizer else model),
            seed=self.seed,
            device=self.device,
            attention_backend=self.attention_backend,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enforce_eager=self.enforce_eager,
            linear_backend=self.linear_backend,
            fused_ops=self.fused_ops,
            fused_layers=self.fused_layers,
            batch_invariant=self.batch_invariant,
            max_logprobs=mcfg.vocab_size if self.max_logprobs == -1 else self.max_logprobs,
            generation_config=self.generation_config,
            parallel=ParallelConfig(self.tensor_parallel_size, self.distributed_executor_backend),
            speculative=SpeculativeConfig.parse(self.speculative_config),
            lora=lora,
        )

    def _hf_overrides(self) -> dict[str, Any] | None:
        """``hf_overrides`` as a dict (vLLM's dict form; its function form needs transformers'
        config object, which pagedllm does not build)."""
        raw = self.hf_overrides
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"hf_overrides={raw!r} is not JSON ({e})") from None
        if raw is not None and not isinstance(raw, dict):
            raise ValueError(f"hf_overrides must be a dict of config.json keys (JSON object on the "
                             f"command line), got {type(raw).__name__}")
        return raw

    def _lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    def _kv_dtype(self, flag: str, override: str | None) -> str:
        """``kv_cache_dtype`` sets K and V storage; ``k_cache_dtype`` / ``v_cache_dtype``
        override one of them (e.g. kv_cache_dtype="auto", v_cache_dtype="int8")."""
        if override is None:
            return normalize_kv_cache_dtype(self.kv_cache_dtype, "kv_cache_dtype")
        return normalize_kv_cache_dtype(override, flag)
