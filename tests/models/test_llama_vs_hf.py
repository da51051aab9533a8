"""Golden tests: our Llama-family model over a paged KV cache against HF transformers' forward."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pagedllm.attention import AttentionMetadata, get_backend
from pagedllm.config import ModelConfig
from pagedllm.models import CausalLM, get_model_class, load_model

VOCAB = 256
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama_gqa_head_dim": ("LlamaConfig", dict(head_dim=32)),  # head_dim != 64 / 4
    "llama_biases": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True)),
    "llama_mqa": ("LlamaConfig", dict(num_key_value_heads=1)),
    "qwen2_tied": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "mistral_window": ("MistralConfig", dict(sliding_window=5, head_dim=16)),
    "qwen3_qk_norm": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True)),
    # layer 0 full attention, layer 1 windowed (max_window_layers), as Qwen2's config reads
    "qwen3_window": ("Qwen3Config", dict(head_dim=16, use_sliding_window=True, sliding_window=5,
                                         max_window_layers=1)),
    "rope_linear": (
        "LlamaConfig",
        dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    ),
    "rope_dynamic": (
        "LlamaConfig",
        dict(rope_parameters={"rope_type": "dynamic", "factor": 3.0, "rope_theta": 10000.0}),
    ),
    "rope_llama3": (
        "LlamaConfig",
        dict(
            head_dim=32,
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
                "rope_theta": 500000.0,
            },
        ),
    ),
}


def make_hf_model(
    kind: str, overrides: dict[str, Any], seed: int = 0
) -> transformers.PreTrainedModel:
    cfg = getattr(transformers, kind)(**{**BASE, **overrides})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, kind.replace("Config", "ForCausalLM"))(cfg).eval()
    with torch.no_grad():  # weights large enough that wrong attention shows in the logits
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return model


def save(model: transformers.PreTrainedModel, path: Path, **kwargs: Any) -> Path:
    model.save_pretrained(path, **kwargs)
    return path


def hf_logits(model: transformers.PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()  # [L, vocab]


def greedy_tokens(model: transformers.PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(hf_logits(model, tokens)[-1].argmax()))
    return tokens


def run_paged(
    model: CausalLM,
    cfg: ModelConfig,
    seqs: list[list[int]],
    schedule: list[list[int]],
    block_size: int = 4,
    seed: int = 0,
) -> list[torch.Tensor]:
    """Run ``seqs`` through ``model`` step by step; ``schedule[s][i]`` new tokens of request i in
    step s (0: not scheduled). Blocks come from a random permutation, so tables are never
    contiguous. Returns each request's logits for every position it processed, [L_i, vocab]."""
    dtype = getattr(torch, cfg.dtype)
    num_blocks = sum(-(-len(s) // block_size) for s in seqs) + 4
    free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    caches = [
        (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
        for _ in range(cfg.num_hidden_layers)
    ]
    tables: list[list[int]] = [[] for _ in seqs]
    done = [0] * len(seqs)
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    for step in schedule:
        reqs = [i for i, n in enumerate(step) if n > 0]
        ids, pos, slots, qsl, lens = [], [], [], [0], []
        for i in reqs:
            for p in range(done[i], done[i] + step[i]):
                if p // block_size == len(tables[i]):
                    tables[i].append(free.pop())
                ids.append(seqs[i][p])
                pos.append(p)
                slots.append(tables[i][p // block_size] * block_size + p % block_size)
            done[i] += step[i]
            qsl.append(qsl[-1] + step[i])
            lens.append(done[i])
        bt = torch.zeros(len(reqs), max(len(tables[i]) for i in reqs), dtype=torch.int32)
        for row, i in enumerate(reqs):
            bt[row, : len(tables[i])] = torch.tensor(tables[i])
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            block_tables=bt,
            max_query_len=max(step),
            max_seq_len=max(lens),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=lens,
        )
        with torch.inference_mode():
            hidden = model(torch.tensor(ids), torch.tensor(pos), caches, meta)  # [T, hidden]
            logits = model.compute_logits(hidden)
        assert logits.dtype == torch.float32 and logits.shape == (len(ids), cfg.vocab_size)
        for row, i in enumerate(reqs):
            out[i].append(logits[qsl[row] : qsl[row + 1]])
    return [torch.cat(x) for x in out]


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_hf(variant: str, tmp_path: Path) -> None:
    kind, overrides = VARIANTS[variant]
    hf = make_hf_model(kind, overrides)
    cfg = ModelConfig.from_hf(str(save(hf, tmp_path)))
    assert cfg.dtype == "float32" and cfg.qk_norm == (kind == "Qwen3Config")
    if variant == "qwen3_window":
        assert (cfg.sliding_window, cfg.full_attention_layers) == (5, (0,))
    backend = "torch_ref" if variant == "llama_mqa" else "cpu"
    model = load_model(cfg, get_backend(backend, "cpu"))

    # One request, whole prompt in one step: logits of every position.
    p0 = prompt(19, seed=1)
    (ours,) = run_paged(model, cfg, [p0], [[len(p0)]])
    torch.testing.assert_close(ours, hf_logits(hf, p0), atol=1e-4, rtol=1e-4)

    # Two requests: chunked prefill mixed with the other's decode steps, HF's greedy tokens fed.
    a = greedy_tokens(hf, prompt(11, seed=2), 3)  # 11 prompt + 3 decode
    b = greedy_tokens(hf, prompt(6, seed=3), 4)  # 6 prompt + 4 decode
    schedule = [[5, 6], [4, 1], [2, 1], [1, 1], [1, 1], [1, 0]]
    got_a, got_b = run_paged(model, cfg, [a, b], schedule, seed=4)
    torch.testing.assert_close(got_a, hf_logits(hf, a), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_b, hf_logits(hf, b), atol=1e-4, rtol=1e-4)


def test_sharded_checkpoint(tmp_path: Path) -> None:
    hf = make_hf_model("LlamaConfig", dict(head_dim=32))
    save(hf, tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    cfg = ModelConfig.from_hf(str(tmp_path))
    model = load_model(cfg, get_backend("cpu", "cpu"))
    p0 = prompt(9, seed=5)
    (ours,) = run_paged(model, cfg, [p0], [[4], [5]], block_size=16)
    torch.testing.assert_close(ours, hf_logits(hf, p0), atol=1e-4, rtol=1e-4)


# Half-precision logits against HF run at the same dtype (not fp32): both round at every op, in a
# different order. Measured max |Δ logit| over Qwen2 (tied) and Llama (head_dim 32), seeds 0..2,
# logits up to ~4.5: bf16 0.083 (HF bf16 vs HF fp32: 0.12), fp16 0.013 (HF: 0.015). Clear argmax
# positions (4..11 of 12 here) must agree exactly.
HALF_ATOL = {"bfloat16": 0.15, "float16": 0.03}


@pytest.mark.parametrize("dtype", list(HALF_ATOL))
@pytest.mark.parametrize("kind,overrides", [("Qwen2Config", dict(tie_word_embeddings=True)),
                                            ("LlamaConfig", dict(head_dim=32)),
                                            ("Qwen3Config", dict(head_dim=32))])
def test_half_precision_matches_hf_at_the_same_dtype(tmp_path: Path, dtype: str, kind: str,
                                                     overrides: dict[str, Any]) -> None:
    hf = make_hf_model(kind, overrides)
    cfg = ModelConfig.from_hf(str(save(hf, tmp_path)), dtype=dtype)
    model = load_model(cfg, get_backend("cpu", "cpu"))
    torch_dtype = getattr(torch, dtype)
    assert all(p.dtype == torch_dtype for p in model.parameters())
    p0 = prompt(12, seed=6)
    (ours,) = run_paged(model, cfg, [p0], [[8], [1], [1], [1], [1]])
    ref = hf_logits(hf.to(torch_dtype), p0)
    atol = HALF_ATOL[dtype]
    assert torch.isfinite(ours).all()
    assert (ours - ref).abs().max() < atol
    # where HF's best logit leads the runner-up by more than 2 atol, the argmax cannot flip
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * atol
    assert clear.sum() >= 3 and torch.equal(ours.argmax(-1)[clear], ref.argmax(-1)[clear])


# Configs written by transformers < 5: rope_theta at top level, rope_scaling with "type" (older)
# or "rope_type"; HF 5 still reads them, and so must ModelConfig.from_hf.
LEGACY_ROPE = {
    "rope_linear": {"type": "linear", "factor": 2.0},
    "rope_llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
}


@pytest.mark.parametrize("variant", list(LEGACY_ROPE))
def test_legacy_rope_scaling_config_is_read(variant: str, tmp_path: Path) -> None:
    kind, overrides = VARIANTS[variant]
    hf = make_hf_model(kind, overrides)
    theta = overrides["rope_parameters"]["rope_theta"]
    path = save(hf, tmp_path)
    cfg_file = path / "config.json"
    data = json.loads(cfg_file.read_text())
    assert "rope_parameters" in data
    del data["rope_parameters"]
    data["rope_theta"], data["rope_scaling"] = theta, LEGACY_ROPE[variant]
    cfg_file.write_text(json.dumps(data))
    cfg = ModelConfig.from_hf(str(path))
    want = {k: v for k, v in overrides["rope_parameters"].items() if k != "rope_theta"}
    assert cfg.rope_theta == theta and cfg.rope_scaling == want
    model = load_model(cfg, get_backend("cpu", "cpu"))
    p0 = prompt(40, seed=7)  # past original_max_position_embeddings=32 (llama3)
    (ours,) = run_paged(model, cfg, [p0], [[23], [17]])
    torch.testing.assert_close(ours, hf_logits(hf, p0), atol=1e-4, rtol=1e-4)


def test_rotary_tables_match_hf() -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from pagedllm.layers import RotaryEmbedding
    from pagedllm.layers.rotary import apply_rotary

    positions = torch.arange(0, 128)
    x = torch.randn(len(positions), 3, 32)
    for _, overrides in VARIANTS.values():
        if "rope_parameters" not in overrides:
            continue
        hf_cfg = transformers.LlamaConfig(**{**BASE, "head_dim": 32, **overrides})
        cos_hf, sin_hf = LlamaRotaryEmbedding(hf_cfg)(x, positions[None])
        scaling = dict(overrides["rope_parameters"])
        theta = scaling.pop("rope_theta")
        rope = RotaryEmbedding(32, hf_cfg.max_position_embeddings, theta, scaling)
        cos, sin = rope(positions)
        expected = (
            x * cos_hf[0, :, None] + torch.cat([-x[..., 16:], x[..., :16]], -1) * sin_hf[0, :, None]
        )
        torch.testing.assert_close(apply_rotary(x, cos, sin), expected, atol=1e-6, rtol=1e-6)


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        ModelConfig.from_hf(str(tmp_path))
    with pytest.raises(ValueError, match="Qwen2ForCausalLM, Qwen3ForCausalLM.*docs/models.md"):
        ModelConfig.from_hf(str(tmp_path))
    with pytest.raises(ValueError, match="LlamaForCausalLM.*MistralForCausalLM.*Qwen2ForCausalLM.*Qwen3"):
        get_model_class("GPT2LMHeadModel")


def test_missing_and_unexpected_tensors(tmp_path: Path) -> None:
    hf = make_hf_model("LlamaConfig", {})
    save(hf, tmp_path)
    cfg = ModelConfig.from_hf(str(tmp_path))
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["model.layers.1.self_attn.k_proj.weight"]
    weights["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ValueError,
        match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*model\.layers\.0\.mlp\.extra\.weight",
    ):
        load_model(cfg, get_backend("cpu", "cpu"))


def test_dynamic_rope_past_max_positions_matches_hf_decode() -> None:
    """Past max_position_embeddings, position p uses the base HF uses when decoding token p."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from pagedllm.layers import RotaryEmbedding

    _, overrides = VARIANTS["rope_dynamic"]
    hf_cfg = transformers.LlamaConfig(**{**BASE, "head_dim": 32, **overrides})
    hf_rope = LlamaRotaryEmbedding(hf_cfg)
    rope = RotaryEmbedding(32, 128, 10000.0, {"rope_type": "dynamic", "factor": 3.0})
    assert rope.max_positions == 384
    x = torch.randn(1, 1, 32)
    for p in [5, 127, 128, 200, 383]:  # increasing, as in decoding
        cos_hf, sin_hf = hf_rope(x, torch.tensor([[p]]))
        cos, sin = rope(torch.tensor([p]))
        torch.testing.assert_close(cos[0, 0], cos_hf[0, 0, :16], atol=1e-4, rtol=0)
        torch.testing.assert_close(sin[0, 0], sin_hf[0, 0, :16], atol=1e-4, rtol=0)
