"""Shared fixtures: tiny random-weight HF checkpoints saved with ``save_pretrained``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("PAGEDLLM_LOG_LEVEL", "WARNING")
torch.set_num_threads(min(2, os.cpu_count() or 1))

VOCAB = 512


def save_word_tokenizer(path: Path, vocab_size: int = VOCAB) -> None:
    """A word-level tokenizer whose every id decodes ("t17" <-> 17): ids map 1:1 to text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="t2", bos_token="t1", unk_token="t0", pad_token="t3"
    )
    fast.save_pretrained(path)


TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)


def make_hf_model(path: Path, arch: str, **overrides: Any) -> Path:
    """Build a random HF model (fixed seed), save weights + tokenizer into ``path``."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    }
    cfg_cls, model_cls = classes[arch]
    kwargs = {**TINY, **overrides}
    torch.manual_seed(1234)
    model = model_cls(cfg_cls(**kwargs)).eval()
    with torch.no_grad():  # HF starts norms at 1: q/k norms that differ show a swapped or unread one
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    save_word_tokenizer(path, kwargs["vocab_size"])
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "llama": make_hf_model(root / "llama", "llama", head_dim=32),  # head_dim != hidden/heads
        "qwen2": make_hf_model(root / "qwen2", "qwen2", tie_word_embeddings=True),
        "mistral": make_hf_model(root / "mistral", "mistral", num_key_value_heads=1),  # MQA
        # per-head q/k norms, head_dim 32 != 64 / 4, tied (as the small Qwen3s)
        "qwen3": make_hf_model(root / "qwen3", "qwen3", head_dim=32, tie_word_embeddings=True),
    }


@pytest.fixture(scope="session")
def make_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``make_model(arch, **overrides)``: one more random checkpoint (e.g. another window)."""

    def make(arch: str, **overrides: Any) -> Path:
        return make_hf_model(tmp_path_factory.mktemp(arch) / arch, arch, **overrides)

    return make


@pytest.fixture(scope="session")
def sampling_model(make_model: Any) -> Path:
    """A Llama with sharper logits than ``tiny_models`` (initializer_range 0.5): every sampling
    option of ``sampling_reference.CONFIGS`` changes some seeded token."""
    return make_model("llama", head_dim=32, initializer_range=0.5)


@pytest.fixture(scope="session")
def sampling_hf(sampling_model: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(sampling_model, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_llama(tiny_models: dict[str, Path]) -> Any:
    """HF transformers on ``tiny_models["llama"]``, fp32: the independent reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def bpe_model(make_model: Any) -> Path:
    """A random-weight Llama with the shipped model's byte-level BPE tokenizer (4096 tokens), for
    tests that need text a grammar can constrain (JSON, regexes, tool calls)."""
    import shutil

    from pagedllm.config import default_model_path

    path = make_model("llama", vocab_size=4096, head_dim=32, eos_token_id=1, bos_token_id=0)
    src = Path(default_model_path())
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(src / name, path / name)
    return path
