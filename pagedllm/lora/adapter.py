"""Load a PEFT LoRA adapter and check it against the base model, mapped onto the fused linears.

    PEFT tensor (base_model.model. stripped)           pagedllm target (module, shard)
    model.layers.3.self_attn.q_proj.lora_A.weight  ->  model.layers.3.self_attn.qkv_proj, 0
    model.layers.3.self_attn.v_proj.lora_B.weight  ->  model.layers.3.self_attn.qkv_proj, 2
    model.layers.3.mlp.down_proj.lora_A.weight     ->  model.layers.3.mlp.down_proj, 0

The fuse table is the model class's ``FUSED_WEIGHTS`` (as models/loader.py). Each target keeps
A [r, in] and B [out_shard, r] with PEFT's scaling (``lora_alpha / r``, or ``/ sqrt(r)`` with
``use_rslora``) folded into B, so the delta of a token is ``B @ (A @ x)``. Everything that does
not fit raises ``LoRAError`` naming the adapter and the reason, before any engine state changes.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from pagedllm.lora.request import LoRARequest
from pagedllm.models.base import CausalLM

SUPPORTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<prefix>.*\.)?(?P<proj>[^.]+)\.lora_(?P<ab>[AB])"
                  r"(?:\.[^.]+)?\.weight$")

Target = tuple[str, int]  # (fused module name, shard index)


class LoRAError(ValueError):
    """An adapter that cannot run on this engine; the message names it and the reason."""


@dataclass
class LoRAWeights:
    """One adapter, loaded on the host: per target, A [r, in] and scaled B [out_shard, r]."""

    request: LoRARequest
    rank: int
    targets: dict[Target, tuple[torch.Tensor, torch.Tensor]]


def tp_shard(module: torch.nn.Module, shard: int, a: torch.Tensor,
             b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This tensor-parallel rank's part of one target's A [r, in] and B [out, r], as vLLM
    shards LoRA: a column-parallel (merged) linear keeps its rows of B (A whole), a row-parallel
    one its columns of A (B whole; the ranks' partial ``A x`` are summed, lora/ops.py)."""
    rows = getattr(module, "source_rows", None)
    if rows is not None:
        return a, b[rows[shard]]
    cols = getattr(module, "source_cols", None)
    return (a, b) if cols is None else (a[:, cols], b)


def load_adapter(req: LoRARequest, model: CausalLM, max_rank: int) -> LoRAWeights:
    """The adapter at ``req.lora_path`` checked against ``model``; raises ``LoRAError``."""
    def fail(reason: str) -> LoRAError:
        return LoRAError(f"LoRA adapter {req.lora_name!r} (id {req.lora_int_id}, "
                         f"{req.lora_path}): {reason}")

    path = Path(req.lora_path)
    cfg_file, st_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    for f in (cfg_file, st_file):
        if not f.is_file():
            raise fail(f"missing file {f.name}; a PEFT adapter directory holds adapter_config.json "
                       "and adapter_model.safetensors (save_pretrained(..., safe_serialization=True))")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise fail(f"adapter_config.json is not JSON ({e})") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise fail(f"peft_type={cfg.get('peft_type')!r}; only LORA adapters are supported")
    if cfg.get("use_dora"):
        raise fail("DoRA (use_dora=true) is not supported")
    if cfg.get("modules_to_save"):
        raise fail(f"modules_to_save={cfg['modules_to_save']} (fully trained modules) is not supported")
    if cfg.get("bias", "none") != "none":
        raise fail(f"bias={cfg['bias']!r} is not supported; only bias='none'")
    if cfg.get("fan_in_fan_out"):
        raise fail("fan_in_fan_out=true (Conv1D layers) is not supported")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise fail("per-module rank_pattern / alpha_pattern is not supported")
    r = int(cfg.get("r", 0))
    if r < 1:
        raise fail(f"r={r} must be >= 1")
    if r > max_rank:
        raise fail(f"rank r={r} is over max_lora_rank={max_rank}; raise --max-lora-rank")
    alpha = float(cfg.get("lora_alpha", r))
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r

    fused = type(model).FUSED_WEIGHTS
    modules = dict(model.named_modules())
    halves: dict[Target, dict[str, torch.Tensor]] = {}
    with safe_open(str(st_file), framework="pt", device="cpu") as f:
        for key in f.keys():
            m = _KEY.match(key)
            if m is None:
                what = ("an embedding target" if "lora_embedding" in key else
                        "DoRA magnitudes" if "magnitude" in key else "a tensor that is not LoRA A/B")
                raise fail(f"{key} is {what}; only LoRA on {', '.join(SUPPORTED)} is supported")
            proj = m["proj"]
            if proj not in SUPPORTED:
                raise fail(f"target module {proj!r} ({key}) is not supported; LoRA runs on "
                           f"{', '.join(SUPPORTED)} (not embeddings or lm_head)")
            name, shard = fused.get(proj, (proj, 0))
            module = modules.get((m["prefix"] or "") + name)
            if not isinstance(module, torch.nn.Linear):
                raise fail(f"{key} names no linear layer of the base model")
            halves.setdefault(((m["prefix"] or "") + name, shard), {})[m["ab"]] = f.get_tensor(key)
    if not halves:
        raise fail("adapter_model.safetensors holds no LoRA tensors")
    targets: dict[Target, tuple[torch.Tensor, torch.Tensor]] = {}
    for (name, shard), ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise fail(f"{name} (shard {shard}) has lora_{''.join(ab)} without its pair")
        a, b = ab["A"], ab["B"]
        module = modules[name]
        assert isinstance(module, torch.nn.Linear)
        a, b = tp_shard(module, shard, a, b)
        sizes = getattr(module, "output_sizes", [module.out_features])
        want_a, want_b = (r, module.in_features), (sizes[shard], r)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise fail(f"{name} (shard {shard}): lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} "
                       f"do not fit the base model, which needs {want_a} / {want_b}")
        targets[(name, shard)] = (a.float().contiguous(), (b.float() * scale).contiguous())
    return LoRAWeights(req, r, targets)
