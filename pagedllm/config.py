"""Frozen configuration objects.

Configs are built once and never mutated (STYLE 6). Values only known at run time (the number of
KV blocks actually allocated, eos ids found in the tokenizer) live in their own objects.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedllm.choices import (
    DTYPE_ALIASES,
    EXECUTOR_BACKENDS,
    KV_CACHE_DTYPE_ALIASES,
    KV_CACHE_DTYPE_NAMES,
    KV_CACHE_DTYPES,
    LINEAR_BACKENDS,
    PREEMPTION_MODES,
    SUPPORTED_DTYPES,
)
from pagedllm.config_hf import SUPPORTED_ARCHITECTURES, arch_traits, read_hf_config, rope_from_hf
from pagedllm.kv.ext_tier import KVTransferConfig
from pagedllm.lora.request import LoRAConfig
from pagedllm.spec_decode.config import SpeculativeConfig

KV_SCALE_BYTES = 2  # bf16 scale per (token, KV head) of a quantized K or V


def normalize_kv_cache_dtype(name: str, flag: str = "kv_cache_dtype") -> str:
    """``fp8`` -> ``fp8_e4m3`` (pagedllm.choices); a ValueError naming ``flag`` for an unknown
    name."""
    resolved = KV_CACHE_DTYPE_ALIASES.get(name, name)
    if resolved not in KV_CACHE_DTYPES:
        raise ValueError(f"{flag}={name!r} is not supported; choose one of "
                         f"{', '.join(KV_CACHE_DTYPE_NAMES)}")
    return resolved


def default_model_path() -> str:
    """The small Llama the project trains and ships (pagedllm/assets/default_model)."""
    return str(Path(__file__).resolve().parent / "assets" / "default_model")


def parse_memory(value: str | int | float) -> int:
    """'4GiB', '512MiB', '2GB', '1e9' or a plain integer of bytes -> bytes."""
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"memory size must be positive, got {value}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([KMGT]i?B?|B)?\s*", value)
    if not m:
        raise ValueError(
            f"cannot parse memory size {value!r}; use e.g. '4GiB', '512MiB', '2GB' or bytes"
        )
    number = float(m.group(1))
    unit = (m.group(2) or "B").upper()
    scale = {
        "B": 1,
        "K": 1024, "KB": 1000, "KIB": 1024,
        "M": 1024**2, "MB": 1000**2, "MIB": 1024**2,
        "G": 1024**3, "GB": 1000**3, "GIB": 1024**3,
        "T": 1024**4, "TB": 1000**4, "TIB": 1024**4,
    }[unit]
    if number <= 0:
        raise ValueError(f"memory size must be positive, got {value!r}")
    return int(number * scale)


def normalize_dtype(dtype: str, config_dtype: str | None) -> str:
    if dtype == "auto":
        resolved = DTYPE_ALIASES.get(str(config_dtype or "float32").replace("torch.", ""))
        # Follow the checkpoint, as vLLM does; unknown or missing dtypes fall back to float32.
        return resolved or "float32"
    resolved = DTYPE_ALIASES.get(dtype)
    if resolved is None:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of auto, {', '.join(SUPPORTED_DTYPES)}")
    return resolved


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family checkpoint, normalised from its HF config.json."""

    model: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    attention_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    hidden_act: str
    sliding_window: int | None
    dtype: str
    bos_token_id: int | None = None
    weight_dtype: str | None = None  # 16-bit linear weights, fp32 compute (linear.w16_dtype)
    eos_token_ids: tuple[int, ...] = ()
    full_attention_layers: tuple[int, ...] = ()  # unwindowed despite sliding_window (Qwen2/3)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3's q_norm / k_norm)
    trust_remote_code: bool = False  # the checkpoint's config / tokenizer code may run (auto_map)

    @classmethod
    def from_hf(cls, model: str, dtype: str = "auto", trust_remote_code: bool = False,
                hf_overrides: dict[str, Any] | None = None) -> ModelConfig:
        """``hf_overrides``: config.json keys replaced before it is read (vLLM's dict form)."""
        from pagedllm.hub import check_checkpoint_format

        path = Path(model)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            check_checkpoint_format(model, None)
            raise ValueError(
                f"model={model!r}: no config.json found; pass a local HF checkpoint directory "
                f"(config.json + *.safetensors + tokenizer files)"
            )
        cfg = read_hf_config(path, trust_remote_code, hf_overrides)
        check_checkpoint_format(model, cfg)
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"model={model!r} has architectures={archs}; pagedllm supports "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} (docs/models.md)"
            )
        theta, scaling = rope_from_hf(cfg)
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act={act!r} is not supported (only silu)")
        n_heads, n_layers = int(cfg["num_attention_heads"]), int(cfg["num_hidden_layers"])
        arch_cfg = arch_traits(arch, cfg, n_layers)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            model=str(path),
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=arch_cfg.head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rope_theta=theta,
            rope_scaling=scaling,
            attention_bias=arch_cfg.attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            hidden_act=act,
            sliding_window=arch_cfg.sliding_window,
            dtype=normalize_dtype(dtype, cfg.get("dtype") or cfg.get("torch_dtype")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            full_attention_layers=arch_cfg.full_attention_layers,
            qk_norm=arch_cfg.qk_norm,
            trust_remote_code=trust_remote_code,
        )

    def layer_sliding_window(self, layer: int) -> int | None:
        """The window layer ``layer`` attends within (None: full attention)."""
        return None if layer in self.full_attention_layers else self.sliding_window

    @property
    def kv_sliding_window(self) -> int | None:
        """The window KV blocks may be freed behind: set only if every layer is windowed."""
        return None if self.full_attention_layers else self.sliding_window

    @property
    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """A layer's projections' (in, out) features, whole: LoRA's A [r, in] and B [out, r]."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element at the model dtype."""
        return 4 if self.dtype == "float32" else 2

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K+V per token over all layers at the model dtype."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None -> default budget (see engine)
    num_kv_blocks: int | None = None  # overrides kv_cache_memory
    enable_prefix_caching: bool = True
    swap_space: int = 0  # bytes of host memory for swapped-out KV blocks (0 = no host tier)
    # Elastic pool: start with ``initial_num_kv_blocks`` and grow in chunks of ``grow_chunk``
    # blocks up to the budget when short; shrink back after compaction when idle.
    initial_num_kv_blocks: int | None = None
    grow_chunk: int = 64
    # Compaction triggers (``LLMEngine.defragment`` is always available on demand): every N steps,
    # and/or when KV utilization (``sched.memory.kv_utilization``) stays below a threshold for
    # ``compact_window_steps`` consecutive steps.
    compact_every_n_steps: int | None = None
    compact_below_utilization: float | None = None
    compact_window_steps: int = 16
    # KV storage precision, K and V chosen separately: "auto" (model dtype) | "int8" |
    # "fp8_e4m3" | "fp8_e5m2" (see KV_CACHE_DTYPES).
    k_cache_dtype: str = "auto"
    v_cache_dtype: str = "auto"
    # Allocation event trace (pagedllm.kv.trace): a JSONL file written while the engine runs.
    kv_trace_path: str | None = None
    kv_events_endpoint: str | None = None  # ZMQ PUB of each step's KV events (kv/publisher.py)
    # Sliding-window models: free the blocks that leave every layer's window (kv/window.py).
    free_window_blocks: bool = True
    kv_transfer: KVTransferConfig | None = None  # the KV tier shared by replicas (kv/transfer.py)

    def __post_init__(self) -> None:
        for flag in ("k_cache_dtype", "v_cache_dtype"):
            if getattr(self, flag) not in KV_CACHE_DTYPES:
                raise ValueError(
                    f"{flag}={getattr(self, flag)!r} is not supported; choose one of "
                    f"{', '.join(KV_CACHE_DTYPES)} (normalize aliases with normalize_kv_cache_dtype)"
                )
        if self.swap_space < 0:
            raise ValueError(f"swap_space={self.swap_space} must be >= 0 bytes")
        if self.initial_num_kv_blocks is not None and self.initial_num_kv_blocks < 1:
            raise ValueError(f"initial_num_kv_blocks={self.initial_num_kv_blocks} must be >= 1")
        if self.grow_chunk < 1:
            raise ValueError(f"grow_chunk={self.grow_chunk} must be >= 1")
        bs = self.block_size
        if not (isinstance(bs, int) and 1 <= bs <= 512 and bs & (bs - 1) == 0):
            raise ValueError(f"block_size={bs!r} must be a power of two in [1, 512]")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks} must be >= 1")

    @property
    def kv_quantized(self) -> bool:
        return self.k_cache_dtype != "auto" or self.v_cache_dtype != "auto"

    def kv_bytes_per_token(self, model: ModelConfig) -> int:
        """Bytes of K+V per token over all layers as stored: model-dtype elements for "auto",
        1-byte values plus a bf16 scale per KV head for a quantized K or V."""
        elem = model.dtype_bytes
        per_head = 0
        for name in (self.k_cache_dtype, self.v_cache_dtype):
            per_head += model.head_dim * elem if name == "auto" else model.head_dim + KV_SCALE_BYTES
        return model.num_hidden_layers * model.num_key_value_heads * per_head

    def kv_bytes_per_block(self, model: ModelConfig) -> int:
        return self.kv_bytes_per_token(model) * self.block_size

    def kv_window(self, model: ModelConfig) -> int | None:
        """The window the KV manager frees blocks behind (None: it keeps every block)."""
        return model.kv_sliding_window if self.free_window_blocks else None

    def num_host_blocks(self, model: ModelConfig) -> int:
        """Blocks of the host (swap) tier: ``swap_space`` bytes of whole blocks."""
        return self.swap_space // self.kv_bytes_per_block(model)

    def kv_dtype_label(self, model: ModelConfig) -> str:
        """'float32' or e.g. 'K float32 + V int8 (bf16 scales)' for logs and ``pagedllm plan``."""
        k = model.dtype if self.k_cache_dtype == "auto" else self.k_cache_dtype
        v = model.dtype if self.v_cache_dtype == "auto" else self.v_cache_dtype
        label = k if k == v else f"K {k} + V {v}"
        return f"{label} (bf16 scales)" if self.kv_quantized else label


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    # Priorities (lower value = more urgent). Requests with priority <= urgent_priority form the
    # urgent class; only they may take the last ``reserved_fraction`` of the KV blocks.
    reserved_fraction: float = 0.1
    urgent_priority: int = 0
    preemption_mode: str = "recompute"  # "recompute" | "swap" | "auto"
    max_loras: int | None = None  # most distinct LoRA adapters in one step (None: LoRA off)

    def __post_init__(self) -> None:
        if not 0.0 <= self.reserved_fraction < 1.0:
            raise ValueError(f"reserved_fraction={self.reserved_fraction} must be in [0, 1)")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode={self.preemption_mode!r} must be one of "
                             f"{', '.join(map(repr, PREEMPTION_MODES))}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 1")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} < max_model_len="
                f"{self.max_model_len} needs chunked prefill; enable it or raise the budget"
            )


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism over ``tensor_parallel_size`` ranks (pagedllm/distributed/): rank 0 runs
    in the engine process, the others in worker processes ("mp") or Ray actors ("ray")."""

    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "mp"  # "mp" | "ray"
    timeout_s: float = 120.0  # a worker silent this long inside a step (collective, start-up) fails

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} must be >= 1")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend={self.distributed_executor_backend!r} "
                             f"must be one of {', '.join(map(repr, EXECUTOR_BACKENDS))} (mp: "
                             f"worker processes)")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s={self.timeout_s} must be > 0")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    tokenizer: str
    seed: int = 0
    device: str = "cpu"
    attention_backend: str | None = None  # None -> chosen by device
    # CUDA only: the KV pool takes this fraction of the GPU's total memory, minus what the
    # weights and a profiled peak of activations use (when neither kv_cache_memory nor
    # num_kv_blocks is given); see runner/memory.py.
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False  # CUDA: every step eager, no CUDA graphs for decode batches
    # CPU: "auto" runs linear layers on packed weights where it can (float32 on pagedllm's own
    # GEMM, else oneDNN: float32, and bfloat16 on CPUs with it; layers/linear.py), "gemm" on
    # pagedllm's GEMM alone (float32, and bfloat16 on CPUs with AVX512-BF16; F.linear where it
    # does not run), "onednn" on oneDNN alone, "torch" always on F.linear.
    linear_backend: str = "auto"
    fused_ops: bool = True  # CPU: RMSNorm(+add), rotary, SiLU-and-mul as C++ ops; False: torch's
    # CPU, with fused_ops: each decoder layer as two C++ ops around its attention
    fused_layers: bool = True  # (kernels/csrc/decoder_layer.cpp); False: its modules one by one
    # default sampling settings: "auto" (the model's generation_config.json), "vllm" (none), or a
    generation_config: str = "auto"  # directory holding the file (pagedllm/generation_config.py)
    extra: dict[str, Any] = field(default_factory=dict)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig | None = None  # pagedllm/spec_decode (None: off)
    batch_invariant: bool = False  # a request's bits whatever the batch (README)
    lora: LoRAConfig | None = None  # pagedllm/lora (None: off, a LoRARequest is refused)
    max_logprobs: int = 20  # largest logprobs / prompt_logprobs a request may ask for

    def __post_init__(self) -> None:
        self._check_batch_invariant()
        if (c := self.cache).kv_transfer is not None:
            c.kv_transfer.check(c.enable_prefix_caching, c.kv_window(self.model))
        dev = self.device
        if not (dev == "cpu" or dev == "cuda" or re.fullmatch(r"cuda:\d+", dev)):
            raise ValueError(f"device={dev!r} must be 'cpu', 'cuda' or 'cuda:N'")
        if self.linear_backend not in LINEAR_BACKENDS:
            raise ValueError(f"linear_backend={self.linear_backend!r}: choose "
                             f"{' or '.join(LINEAR_BACKENDS)} (--linear-backend)")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs={self.max_logprobs} must be >= 0 (or -1 in "
                             "EngineArgs: the vocabulary)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")

    def _check_batch_invariant(self) -> None:
        """What batch-invariant mode does not cover, refused by name (CPU or Triton kernels)."""
        cpu = (self.attention_backend or self.device) == "cpu"  # else triton (or refused)
        for bad, why in [
            (self.device != "cpu" and self.attention_backend not in (None, "triton"),
             "on CUDA it runs on the triton attention backend; use --attention-backend triton"),
            (cpu and self.linear_backend not in ("auto", "gemm"), "use --linear-backend auto"),
            (cpu and not self.fused_ops, "torch's RMSNorm may split a row; drop --no-fused-ops"),
            (self.parallel.tensor_parallel_size > 1, "the all-reduce's order varies; use -tp 1"),
            (self.speculative is not None, "not covered; drop --speculative-config"),
            (self.lora is not None, "LoRA deltas run on torch's matmuls; drop --enable-lora")]:
            if bad and self.batch_invariant:
                raise ValueError(f"--batch-invariant: {why}, or drop --batch-invariant")

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def kv_sized_by_profile(self) -> bool:
        """On CUDA without an explicit size, the KV pool is what a memory profile leaves."""
        c = self.cache
        return self.is_cuda and c.num_kv_blocks is None and c.kv_cache_memory is None
