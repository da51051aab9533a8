"""Readings of a HF ``config.json`` that transformers spreads over several keys or versions."""

from __future__ import annotations

from typing import Any


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
    """Qwen2's full-attention layers as transformers reads them: ``layer_types`` when given, else
    every layer below ``max_window_layers`` (default 28) when the window is on."""
    types = cfg.get("layer_types")
    if not types:
        below = int(cfg.get("max_window_layers", 28))
        types = ["sliding_attention" if sliding is not None and i >= below else "full_attention"
                 for i in range(n_layers)]
    if len(types) != n_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {n_layers} layers")
    return tuple(i for i, t in enumerate(types) if t != "sliding_attention")
