"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flat, unpadded batch with a paged
KV cache.

Differences inside the family are config values: GQA/MQA head counts, head_dim independent of
hidden_size / num_heads, q/k/v bias (Qwen2, or Llama's attention_bias, which also biases o_proj),
mlp_bias, tied embeddings, Qwen3's per-head RMSNorm of q and k before RoPE (q_norm / k_norm,
weights [head_dim], replicated under TP), and a sliding window handed to the attention backend
(Mistral; Qwen2 and Qwen3 on the layers their config makes windowed).
Parameter names mirror HF's, except q|k|v -> qkv_proj and gate|up -> gate_up_proj (fused; see
``FUSED_WEIGHTS`` and models/loader.py).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from pagedllm import kernels
from pagedllm.attention.base import AttentionBackend, AttentionMetadata
from pagedllm.config import ModelConfig
from pagedllm.distributed.group import TPGroup, rows, shard_heads
from pagedllm.layers import MergedLinear, RMSNorm, RotaryEmbedding, SiluAndMul
from pagedllm.layers.linear import Linear, row_parallel_linear
from pagedllm.layers.rotary import apply_rotary_qk
from pagedllm.lora.ops import LoRAMapping
from pagedllm.models.base import CausalLM, KVCache


class LlamaAttention(nn.Module):
    fused = True  # rotary may run the fused CPU op (kernels.set_fused_ops)

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, tp: TPGroup | None = None,
                 layer: int = 0) -> None:
        super().__init__()
        hs = shard_heads(cfg.num_attention_heads, cfg.num_key_value_heads, tp)  # this rank's heads
        self.num_heads, self.num_kv_heads = hs.num_heads, hs.num_kv_heads
        self.head_dim = d = cfg.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        kv_rows = rows(hs.kv_start, hs.num_kv_heads, d)
        self.qkv_proj = MergedLinear(
            cfg.hidden_size, [q_size, kv_size, kv_size], bias=cfg.attention_bias,
            source_rows=None if tp is None else [rows(hs.q_start, hs.num_heads, d), kv_rows, kv_rows],
        )
        # Qwen2 biases q/k/v only; Llama's attention_bias covers o_proj too.
        o_bias = cfg.attention_bias and cfg.architecture != "Qwen2ForCausalLM"
        self.o_proj = row_parallel_linear(q_size, cfg.hidden_size, o_bias, tp)
        self.backend = backend
        self.scale = self.head_dim**-0.5
        self.sliding_window = cfg.layer_sliding_window(layer)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if meta.lora is not None:
            qkv = meta.lora.apply(self.qkv_proj, x, qkv)
        q, k, v = qkv.split(self.qkv_proj.output_sizes, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.q_norm is not None and self.k_norm is not None:  # each head's row of D, as HF
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        q, k = apply_rotary_qk(q, k, cos, sin, self.fused)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        o = self.backend.forward(
            q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.sliding_window
        )
        o = o.reshape(t, self.num_heads * self.head_dim)
        return self.o_proj(o) if meta.lora is None else meta.lora.apply(self.o_proj, o, self.o_proj(o))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        start, i = tp.split(cfg.intermediate_size, "intermediate_size") if tp else (0, cfg.intermediate_size)
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [i, i], bias=cfg.mlp_bias,
                                         source_rows=None if tp is None else [rows(start, i)] * 2)
        self.down_proj = row_parallel_linear(i, cfg.hidden_size, cfg.mlp_bias, tp)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor, lora: LoRAMapping | None = None) -> torch.Tensor:
        if lora is None:
            return self.down_proj(self.act(self.gate_up_proj(x)))
        h = self.act(lora.apply(self.gate_up_proj, x, self.gate_up_proj(x)))
        return lora.apply(self.down_proj, h, self.down_proj(h))


NO_LORA: tuple[list[torch.Tensor], list[int]] = ([], [])  # a linear's LoRA op args: none


class LlamaDecoderLayer(nn.Module):
    fused = True  # may run the fused CPU ops (kernels.set_fused_ops)
    # and, where it can, as the two decoder-layer ops (kernels.set_fused_ops(.., "fused_layer"))
    fused_layer = True

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, tp: TPGroup | None = None,
                 layer: int = 0) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, backend, tp, layer)
        self.mlp = LlamaMLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # what the two ops cover: one rank, a backend that attends apart from the KV write, and
        # no q/k norms (attn_in goes from the hidden states to roped q/k in one op)
        two_ops = tp is None and not cfg.qk_norm
        self.attend = getattr(backend, "attend", None) if two_ops else None
        # the linear that runs after this layer's down_proj (the next layer's qkv_proj, or the
        # LM head), in a tuple so that it is not a submodule: the GEMM fetches its first panels
        self.after: tuple[Linear, ...] = ()

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]: the previous layer's output (the embeddings at layer 0)
        residual: torch.Tensor | None,  # the running sum it is added to (None at layer 0)
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (this layer's MLP output, the running sum before it). Each residual add is fused
        into the norm that follows it: ``residual + x`` then ``norm``, the same arithmetic as
        ``x = x + attn(norm(x)); x = x + mlp(norm(x))``."""
        # adapters' deltas: in the two ops on a "dense" step, else the modules one by one
        if (self.fused and self.fused_layer and self.attend is not None
                and (meta.lora is None or meta.lora.fusable)
                and type(kv_cache[0]) is type(kv_cache[1]) is torch.Tensor and kernels.fused(x)):
            return self._forward_ops(x, residual, cos, sin, kv_cache, meta)
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_norm(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, meta)
        h, residual = self.post_attention_layernorm.add_norm(h, residual)
        return self.mlp(h, meta.lora), residual

    def _forward_ops(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` as two C++ ops around the attention (kernels/csrc/decoder_layer.cpp):
        the same ops in the same order, without ~25 Python-level calls per layer."""
        attn, mlp, norm1, norm2 = self.self_attn, self.mlp, self.input_layernorm, self.post_attention_layernorm
        k_cache, v_cache = kv_cache
        lora = meta.lora
        if lora is None:  # the common step: no per-linear work
            qkv_lora = o_lora = gate_up_lora = down_lora = NO_LORA
            onehot = None
        else:
            qkv_lora, o_lora, gate_up_lora, down_lora = (
                lora.op_args(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                          mlp.down_proj))
            onehot = lora.onehot
        q = torch.ops.pagedllm.attn_in(  # [T, Hq, D]; the new K/V are in their slots
            x, residual, norm1.weight, norm1.eps, *attn.qkv_proj.op_args(), cos, sin,
            attn.num_heads, attn.num_kv_heads, k_cache, v_cache, meta.slot_mapping,
            attn.o_proj.packed, onehot, *qkv_lora)
        residual = x if residual is None else residual
        assert self.attend is not None
        o = self.attend(q, k_cache, v_cache, meta, attn.scale, attn.sliding_window)
        h = torch.ops.pagedllm.attn_out_mlp(
            o, residual, *attn.o_proj.op_args(), norm2.weight, norm2.eps,
            *mlp.gate_up_proj.op_args(), *mlp.down_proj.op_args(),
            self.after[0].packed if self.after else None, onehot, *o_lora, *gate_up_lora,
            *down_lora)
        return h, residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)  # replicated under TP
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, backend, tp, i) for i in range(cfg.num_hidden_layers)
        )
        layers = [cast(LlamaDecoderLayer, m) for m in self.layers]
        for layer, following in zip(layers, layers[1:]):
            layer.after = (following.self_attn.qkv_proj,)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary_emb(positions)  # [T, 1, D/2] each, shared by all layers
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos, sin, kv_cache, meta)
        return self.norm.add_norm(x, residual)[0] if residual is not None else self.norm(x)


class LlamaForCausalLM(CausalLM):
    FUSED_WEIGHTS: dict[str, tuple[str, int]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, tp: TPGroup | None = None) -> None:
        """``tp``: this rank's tensor-parallel group (see distributed/group.py); None: unsharded."""
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, backend, tp)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)  # replicated
        cast(LlamaDecoderLayer, self.model.layers[-1]).after = (self.lm_head,)
        if cfg.tie_word_embeddings:
            self.tie_weights()

    @property
    def max_positions(self) -> int:
        """Positions the rotary table covers; max_model_len must not exceed it."""
        return self.model.rotary_emb.max_positions

    def tie_weights(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """-> final hidden states [T, hidden] (normed); pick rows, then ``compute_logits``."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] fp32 (``fp32=False``: in the model's dtype)."""
        logits = self.lm_head(hidden)
        return logits.float() if fp32 else logits
