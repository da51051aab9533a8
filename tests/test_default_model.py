"""Checks on the embedded default model (pagedllm/assets/default_model).

The model is produced by ``scripts/train_default_model.py``. The greedy token ids below
were recorded from the shipped weights; they are a regression guard that fails if the
weights, the tokenizer or the HF reference forward pass change. If the model is
deliberately retrained, re-record them (see ``_record`` at the bottom).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch  # hard dependencies: a missing one is a failure, not a skip
import transformers  # noqa: F401

MODEL_DIR = Path(__file__).resolve().parents[1] / "pagedllm" / "assets" / "default_model"

# prompt -> token ids of the first 16 greedily generated tokens (fp32, HF reference).
GOLDEN_GREEDY = {
    # '\n        """\n        Return the current file of the file of the file.\n\n        The'
    "def fibonacci(n):": [272, 388, 272, 1194, 300, 1109, 478, 391, 300, 478, 391, 300, 478, 19, 415, 603],
    # ' #\n#\n#\n#\n#\n#\n#\n#\n'
    "import ": [288, 204, 8, 204, 8, 204, 8, 204, 8, 204, 8, 204, 8, 204, 8, 204],
    # " #  A\n    '        #  0x -> LATIN CAPITAL LETTER L\n   "
    "def ": [288, 226, 406, 271, 275, 267, 288, 226, 294, 93, 338, 420, 500, 385, 316, 271],
}
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    m.eval()
    return m


def test_files_present_and_small():
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "README.md"):
        assert (MODEL_DIR / name).is_file(), name
    total = sum(f.stat().st_size for f in MODEL_DIR.rglob("*") if f.is_file())
    assert total < 25 * 1024 * 1024, total


def test_config_gqa_and_context():
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]
    assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0
    assert cfg["max_position_embeddings"] >= 512
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "float32"


def test_tokenizer_special_tokens_and_roundtrip(tokenizer):
    assert tokenizer.is_fast
    assert tokenizer.bos_token == "<|bos|>" and tokenizer.bos_token_id is not None
    assert tokenizer.eos_token == "<|eos|>" and tokenizer.eos_token_id is not None
    assert tokenizer.pad_token == "<|pad|>" and tokenizer.pad_token_id is not None
    for text in ["héllo wörld ✓ 日本", "def f(x):\n\treturn x  # ünïcödé 🐍\r\n", ""]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
    # no BOS inserted implicitly
    assert tokenizer.bos_token_id not in tokenizer("x = 1")["input_ids"]


def test_chat_template(tokenizer):
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|assistant|>\n")
    assert "<|user|>\nhi<|eos|>" in text


@pytest.mark.parametrize("prompt", sorted(GOLDEN_GREEDY))
def test_greedy_regression(model, tokenizer, prompt):
    enc = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(
            **enc,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    new_ids = out[0, enc["input_ids"].shape[1]:].tolist()
    assert new_ids == GOLDEN_GREEDY[prompt], (prompt, new_ids, tokenizer.decode(new_ids))


def _record():  # pragma: no cover - helper for re-recording the golden ids
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    m = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    for p in GOLDEN_GREEDY:
        enc = tok(p, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            out = m.generate(**enc, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, pad_token_id=tok.pad_token_id)
        ids = out[0, enc["input_ids"].shape[1]:].tolist()
        print(f"    {p!r}: {ids},  # {tok.decode(ids)!r}")


if __name__ == "__main__":  # pragma: no cover
    _record()
