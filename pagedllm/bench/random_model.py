"""Build a random-weight Llama checkpoint (HF format) for benchmarks at a realistic size.

    pagedllm bench random-model /tmp/llama-100m              # ~96M parameters, fp32
    pagedllm bench random-model /tmp/llama-1b --preset 1b    # ~0.99B parameters, bf16 (~2 GB)
    pagedllm bench random-model /tmp/mistral --sliding-window 64   # a Mistral: windowed attention
    python -m pagedllm.bench.random_model /tmp/llama-100m

Weights are random (seeded), so outputs are noise, but every cost that matters for serving
(matmuls, KV bytes per token, attention over long contexts) is that of a real model of this
shape. The tokenizer is copied from ``--tokenizer`` (default: the shipped model's), so prompts
and vocabulary match the default model's.

The model is built directly in its storage dtype (``--dtype``; the 1b preset defaults to
bfloat16, so building it needs ~2 GB of RAM, not the 4 GB of fp32, and config.json says
bfloat16, which ``--dtype auto`` then follows) and optionally on a GPU (``--device cuda``: the
random init runs there, which is much faster than on a few CPU cores).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

from pagedllm.choices import SUPPORTED_DTYPES

PRESETS: dict[str, dict[str, Any]] = {
    # Llama-3.2-1B's body (hidden 2048, 16 layers, 32 q / 8 kv heads of 64, MLP 8192) with the
    # 4096-token vocab: 16 x (attention 10.49M + MLP 50.33M) + 2 x 4096 x 2048 ~= 0.99B
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096),
    # 12 x (attention 1.57M + MLP 5.90M) + 2 x 4096 x 768 embeddings ~= 96M with a 4096 vocab
    "100m": dict(hidden_size=768, intermediate_size=2560, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=1024),
    # the two shapes of the CPU comparison with vLLM (README "Performance"): a 32k vocabulary
    # (larger than the shipped tokenizer's 4096; ids past it decode to nothing) makes the LM head
    # a real share of the work. 12 x (1.57M + 4.72M) + 2 x 32000 x 768 ~= 125M
    "125m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=1024,
                 vocab_size=32000),
    # 4 x (0.20M + 0.49M) + 2 x 4096 x 256 ~= 4.9M
    "5m": dict(hidden_size=256, intermediate_size=640, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
}

PRESET_DTYPES = {"1b": "bfloat16"}  # others: float32

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "tokenizer.model", "chat_template.jinja")


def llama_param_count(vocab_size: int, hidden_size: int, intermediate_size: int,
                      num_hidden_layers: int, num_attention_heads: int, num_key_value_heads: int,
                      head_dim: int | None = None, tie_word_embeddings: bool = False,
                      **_: Any) -> int:
    """Parameters of a bias-free Llama: per layer q/k/v/o, gate/up/down and two RMSNorms; the
    embedding, the final norm and (untied) the LM head."""
    d = head_dim or hidden_size // num_attention_heads
    attn = hidden_size * d * (2 * num_attention_heads + 2 * num_key_value_heads)
    layer = attn + 3 * hidden_size * intermediate_size + 2 * hidden_size
    embed = vocab_size * hidden_size * (1 if tie_word_embeddings else 2)
    return num_hidden_layers * layer + embed + hidden_size


def build_random_model(out: str | Path, preset: str = "100m", tokenizer: str | None = None,
                       seed: int = 0, dtype: str | None = None, device: str = "cpu",
                       sliding_window: int | None = None, **overrides: Any) -> int:
    """Write the checkpoint into ``out``; returns the parameter count. ``dtype`` None takes the
    preset's (``PRESET_DTYPES``, else float32). ``sliding_window``: a Mistral of the same shape
    whose every layer attends to its last that many positions."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    from pagedllm.config import default_model_path
    from pagedllm.tokenizer import get_tokenizer

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    dtype = dtype or PRESET_DTYPES.get(preset, "float32")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose {', '.join(SUPPORTED_DTYPES)}")
    tok_dir = Path(tokenizer or default_model_path())
    tok = get_tokenizer(str(tok_dir))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config_cls: Any = LlamaConfig if sliding_window is None else MistralConfig
    model_cls: Any = LlamaForCausalLM if sliding_window is None else MistralForCausalLM
    if sliding_window is not None:
        overrides = {"sliding_window": sliding_window, **overrides}
    cfg = config_cls(
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        **{"vocab_size": len(tok), **PRESETS[preset], **overrides},  # a preset may set vocab
    )
    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))  # allocate and init in the storage dtype
    try:
        with torch.device(device):
            model = model_cls(cfg).eval()
    finally:
        torch.set_default_dtype(prev)
    model.to("cpu").save_pretrained(out)  # config.json records the parameters' dtype
    copied = False
    for name in _TOKENIZER_FILES:
        if (tok_dir / name).is_file():
            shutil.copy(tok_dir / name, out / name)
            copied = True
    if not copied:
        tok.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


COMMAND = "random-model"
HELP = "write a random-weight Llama checkpoint (presets: 100m, 1b, tiny)"


def add_cli_args(p: argparse.ArgumentParser) -> None:

    p.add_argument("out", type=Path, help="output checkpoint directory")
    p.add_argument("--preset", choices=sorted(PRESETS), default="100m")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the shipped model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=SUPPORTED_DTYPES, default=None,
                   help="storage dtype (default: bfloat16 for 1b, float32 otherwise)")
    p.add_argument("--device", default="cpu",
                   help="where the random init runs (cuda is much faster for 1b); saved from CPU")
    p.add_argument("--sliding-window", type=int, default=None, metavar="N",
                   help="build a MistralForCausalLM whose layers attend to their last N positions")


def run(a: argparse.Namespace) -> int:
    """The command for parsed ``add_cli_args`` flags (``pagedllm bench random-model`` and ``main``)."""
    n = build_random_model(a.out, a.preset, a.tokenizer, a.seed, a.dtype, a.device,
                           a.sliding_window)
    arch = "" if a.sliding_window is None else f", Mistral with sliding window {a.sliding_window}"
    print(f"wrote {a.out} ({n / 1e6:.1f}M parameters, random weights, preset {a.preset}{arch})")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cli_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
