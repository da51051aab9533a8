"""Build a model without allocating random weights, then stream safetensors into it tensor by tensor.

    checkpoint name                              model parameter (shard rows)
    model.layers.3.self_attn.q_proj.weight   ->  model.layers.3.self_attn.qkv_proj.weight [0:q]
    model.layers.3.self_attn.k_proj.weight   ->  ...qkv_proj.weight [q:q+kv]
    model.layers.3.mlp.up_proj.weight        ->  model.layers.3.mlp.gate_up_proj.weight [I:2I]
    anything else                            ->  the parameter of the same name

The fuse table is the model class's ``FUSED_WEIGHTS``; shard row ranges come from the fused
module's ``output_sizes`` (layers/linear.py). Under tensor parallelism a module's
``source_index`` names the slice of the checkpoint tensor this rank owns, and only that slice is
read (``safe_open(...).get_slice``), so no rank ever holds a full sharded tensor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from pagedllm.attention.base import AttentionBackend
from pagedllm.config import ModelConfig
from pagedllm.layers import MergedLinear, RotaryEmbedding
from pagedllm.layers.linear import RowParallelLinear
from pagedllm.models.base import CausalLM
from pagedllm.models.registry import get_model_class

if TYPE_CHECKING:
    from pagedllm.distributed.group import TPGroup

SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)  # old checkpoints saved this buffer

Target = tuple[str, int | None]  # (parameter name, shard index or None for the whole tensor)


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    path = Path(model_dir)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"no *.safetensors files in {path}; pagedllm loads safetensors checkpoints only "
            f"(re-save the model with save_pretrained(..., safe_serialization=True))"
        )
    return files


def load_model(config: ModelConfig, backend: AttentionBackend, device: str = "cpu",
               tp: TPGroup | None = None) -> CausalLM:
    """The model at ``config.dtype`` on ``device``, in eval mode, weights from ``config.model``;
    with ``tp``, this rank's shard of it."""
    cls = get_model_class(config.architecture)
    with torch.device("meta"):
        model = cls(config, backend) if tp is None else cls(config, backend, tp)  # type: ignore[call-arg]
    model.to(getattr(torch, config.dtype)).to_empty(device=device)
    for m in model.modules():
        if isinstance(m, RotaryEmbedding):  # non-persistent fp32 table, recomputed, not loaded
            m.cos_sin_cache = m.compute_cache(device)
    fused = cls.FUSED_WEIGHTS
    if config.tie_word_embeddings:
        model.tie_weights()
    params = dict(model.named_parameters())  # tied lm_head.weight appears once, as embed_tokens
    expected: set[Target] = set()
    for name in params:
        module = model.get_submodule(name.rpartition(".")[0])
        if isinstance(module, MergedLinear):
            expected |= {(name, j) for j in range(len(module.output_sizes))}
        else:
            expected.add((name, None))

    def target(ckpt_name: str) -> Target:
        prefix, proj, leaf = _split_last_two(ckpt_name)
        if proj in fused:
            new_proj, shard = fused[proj]
            return f"{prefix}{new_proj}.{leaf}", shard
        return ckpt_name, None

    loaded: set[Target] = set()
    unexpected: list[str] = []
    for file in checkpoint_files(config.model):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for ckpt_name in f.keys():
                if ckpt_name.endswith(SKIPPED_SUFFIXES):
                    continue
                if ckpt_name == "lm_head.weight" and config.tie_word_embeddings:
                    continue
                name, shard = target(ckpt_name)
                if (name, shard) not in expected:
                    unexpected.append(ckpt_name)
                    continue
                param = params[name]
                dst = param.data
                module = model.get_submodule(name.rpartition(".")[0])
                if shard is not None:
                    assert isinstance(module, MergedLinear)
                    dst = dst[module.shard_rows(shard)]
                index = None
                if tp is not None and isinstance(module, (MergedLinear, RowParallelLinear)):
                    index = module.source_index(shard, name.rpartition(".")[2])
                tensor = f.get_tensor(ckpt_name) if index is None else f.get_slice(ckpt_name)[index]
                if tensor.shape != dst.shape:
                    raise ValueError(
                        f"{file.name}: tensor {ckpt_name} has shape {tuple(tensor.shape)}, the model "
                        f"expects {tuple(dst.shape)}; does config.json match the weights?"
                    )
                dst.copy_(tensor)
                loaded.add((name, shard))
    missing = expected - loaded
    if ("lm_head.weight", None) in missing:  # no lm_head in the checkpoint: tie to embeddings
        model.tie_weights()
        missing.discard(("lm_head.weight", None))
    if missing or unexpected:
        inverse = {v: k for k, v in fused.items()}
        names = sorted(_ckpt_name(n, s, inverse) for n, s in missing)
        raise ValueError(
            f"checkpoint {config.model} does not match {config.architecture}: "
            f"missing tensors {names[:20]}{' ...' if len(names) > 20 else ''}; "
            f"unexpected tensors {sorted(unexpected)[:20]}{' ...' if len(unexpected) > 20 else ''}"
        )
    model.requires_grad_(False)
    return model.eval()


def _split_last_two(name: str) -> tuple[str, str, str]:
    """'a.b.q_proj.weight' -> ('a.b.', 'q_proj', 'weight')."""
    head, _, leaf = name.rpartition(".")
    prefix, _, proj = head.rpartition(".")
    return (prefix + "." if prefix else ""), proj, leaf


def _ckpt_name(name: str, shard: int | None, inverse: dict[tuple[str, int], str]) -> str:
    if shard is None:
        return name
    prefix, proj, leaf = _split_last_two(name)
    return f"{prefix}{inverse[(proj, shard)]}.{leaf}"
