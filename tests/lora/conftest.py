"""Random PEFT adapters (saved with ``save_pretrained``) on the tiny random Llama."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

# name -> (LoraConfig kwargs); different ranks, scalings and targets
ADAPTERS: dict[str, dict[str, Any]] = {
    "attn_r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "all_r8_rslora": dict(r=8, lora_alpha=16, use_rslora=True,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                          "up_proj", "down_proj"]),
    "mlp_r16_layer1": dict(r=16, lora_alpha=8, layers_to_transform=[1],
                           target_modules=["gate_proj", "up_proj", "down_proj"]),
    "v_down_r2": dict(r=2, lora_alpha=4, target_modules=["v_proj", "down_proj"]),
}


def make_adapter(base: Path, path: Path, seed: int, **kwargs: Any) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **kwargs))
    with torch.no_grad():  # B's default init is small: make each adapter change the tokens
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.mul_(4.0)
    peft_model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def lora_base(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def adapters(lora_base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter(lora_base, root / name, seed, **kw)
            for seed, (name, kw) in enumerate(ADAPTERS.items())}


def edited_copy(src: Path, dst: Path, config: dict[str, Any] | None = None,
                tensors: dict[str, torch.Tensor | None] | None = None) -> Path:
    """A copy of adapter ``src`` with config keys and tensors replaced (None: removed)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        (dst / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    if tensors:
        t = load_file(str(dst / "adapter_model.safetensors"))
        for k, v in tensors.items():
            if v is None:
                t.pop(k)
            else:
                t[k] = v
        save_file(t, str(dst / "adapter_model.safetensors"))
    return dst
