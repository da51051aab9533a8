"""Readings of a HF ``config.json`` that transformers spreads over several keys or versions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

# HF ``architectures`` names that load (models/registry.py maps each to its class; docs/models.md)
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM")


class ArchTraits(NamedTuple):
    """What sets one family member apart, as config values (see ``arch_traits``)."""

    head_dim: int
    attention_bias: bool  # q/k/v biases (and o_proj's, but for Qwen2)
    sliding_window: int | None
    full_attention_layers: tuple[int, ...]  # unwindowed despite sliding_window
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)


def arch_traits(arch: str, cfg: dict[str, Any], n_layers: int) -> ArchTraits:
    """Read ``arch``'s config.json the way transformers' config class for it does. Qwen2 biases
    q/k/v always; Qwen2 and Qwen3 window the layers their config makes windowed; Mistral windows
    every layer (transformers ignores a Mistral's layer_types); Llama and Qwen3 read
    ``attention_bias``. A missing ``head_dim`` is hidden / heads, but Qwen3's default is 128."""
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or (128 if arch == "Qwen3ForCausalLM" else hidden // heads))
    bias = bool(cfg.get("attention_bias", False))
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
        full = qwen2_full_layers(cfg, n_layers, sliding)
        if len(full) == n_layers:
            sliding, full = None, ()
        return ArchTraits(head_dim, bias or arch == "Qwen2ForCausalLM",
                          int(sliding) if sliding else None, full if sliding else (),
                          arch == "Qwen3ForCausalLM")
    sliding = cfg.get("sliding_window") if arch == "MistralForCausalLM" else None
    return ArchTraits(head_dim, bias, int(sliding) if sliding else None, (), False)


def rope_from_hf(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Read RoPE settings the way transformers does.

    transformers >= 5 writes ``rope_parameters`` (with ``rope_theta`` inside); older versions
    write ``rope_theta`` at top level and ``rope_scaling`` (keys ``type`` or ``rope_type``).
    Returns (theta, scaling) where scaling is None for plain RoPE, else a dict with ``rope_type``.
    """
    params = cfg.get("rope_parameters")
    scaling: dict[str, Any] | None
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        raw = cfg.get("rope_scaling")
        scaling = dict(raw) if isinstance(raw, dict) else None
    if scaling is not None:
        rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
        scaling.pop("type", None)
        if rope_type == "default":
            return theta, None
        if rope_type not in ("linear", "dynamic", "llama3"):
            raise ValueError(
                f"rope type {rope_type!r} is not supported; supported: default, linear, dynamic, llama3"
            )
        scaling["rope_type"] = rope_type
    return theta, scaling


def qwen2_full_layers(cfg: dict[str, Any], n_layers: int,
                       sliding: int | None) -> tuple[int, ...]:
    """Qwen2's (and Qwen3's) full-attention layers as transformers reads them: ``layer_types`` when given, else
    every layer below ``max_window_layers`` (default 28) when the window is on."""
    types = cfg.get("layer_types")
    if not types:
        below = int(cfg.get("max_window_layers", 28))
        types = ["sliding_attention" if sliding is not None and i >= below else "full_attention"
                 for i in range(n_layers)]
    if len(types) != n_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {n_layers} layers")
    return tuple(i for i, t in enumerate(types) if t != "sliding_attention")


def read_hf_config(path: Path, trust_remote_code: bool,
                   overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """``path/config.json`` as a dict, read as transformers' ``AutoConfig`` would: a config
    whose ``auto_map`` names its own ``AutoConfig`` class is read through that class (its code
    runs, its defaults fill what the file leaves out) only with ``trust_remote_code``; without
    it the file is read as written when transformers knows its ``model_type``, and refused when
    it does not. ``overrides`` then replace keys (vLLM's ``hf_overrides``)."""
    cfg: dict[str, Any] = json.loads((path / "config.json").read_text())
    auto_map = cfg.get("auto_map")
    if isinstance(auto_map, dict) and "AutoConfig" in auto_map:
        from transformers import AutoConfig
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        if trust_remote_code:
            custom = AutoConfig.from_pretrained(str(path), trust_remote_code=True,
                                                local_files_only=True)
            cfg = {**cfg, **custom.to_dict()}
        elif cfg.get("model_type") not in CONFIG_MAPPING:
            raise ValueError(
                f"{path}/config.json needs its own code ({auto_map['AutoConfig']}) for "
                f"model_type={cfg.get('model_type')!r}, which transformers does not know; pass "
                f"trust_remote_code=True (--trust-remote-code) if you trust that code")
    return {**cfg, **(overrides or {})}
