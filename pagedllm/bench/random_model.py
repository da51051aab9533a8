"""Build a random-weight Llama checkpoint (HF format) for benchmarks at a realistic size.

    pagedllm bench random-model /tmp/llama-100m              # ~96M parameters
    python -m pagedllm.bench.random_model /tmp/llama-100m

Weights are random (seeded), so outputs are noise, but every cost that matters for serving
(matmuls, KV bytes per token, attention over long contexts) is that of a real model of this
shape. The tokenizer is copied from ``--tokenizer`` (default: the shipped model's), so prompts
and vocabulary match the default model's.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # 12 x (attention 1.57M + MLP 5.90M) + 2 x 4096 x 768 embeddings ~= 96M with a 4096 vocab
    "100m": dict(hidden_size=768, intermediate_size=2560, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=1024),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
}

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "tokenizer.model", "chat_template.jinja")


def build_random_model(out: str | Path, preset: str = "100m", tokenizer: str | None = None,
                       seed: int = 0, **overrides: Any) -> int:
    """Write the checkpoint into ``out``; returns the parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedllm.config import default_model_path
    from pagedllm.tokenizer import get_tokenizer

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    tok_dir = Path(tokenizer or default_model_path())
    tok = get_tokenizer(str(tok_dir))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        **{**PRESETS[preset], **overrides},
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(out)
    copied = False
    for name in _TOKENIZER_FILES:
        if (tok_dir / name).is_file():
            shutil.copy(tok_dir / name, out / name)
            copied = True
    if not copied:
        tok.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", type=Path, help="output checkpoint directory")
    p.add_argument("--preset", choices=sorted(PRESETS), default="100m")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the shipped model)")
    p.add_argument("--seed", type=int, default=0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    a = p.parse_args(argv)
    n = build_random_model(a.out, a.preset, a.tokenizer, a.seed)
    print(f"wrote {a.out} ({n / 1e6:.1f}M parameters, random weights, preset {a.preset})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
