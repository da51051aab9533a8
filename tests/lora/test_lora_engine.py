"""Multi-LoRA end to end: greedy tokens identical to HF + PEFT for a mixed batch (fp32),
max_loras=1 with many adapters, prefix-cache isolation across adapters, bad adapters that fail
alone."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.lora import lora_extra_keys

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

_HF: dict[tuple[str, str | None, tuple[tuple[int, ...], ...]], list[list[int]]] = {}


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 512) for _ in range(rng.choice([3, 17, 40, 70]))] for _ in range(n)]


def hf_peft_greedy(base: Path, adapter: Path | None, prompts: list[list[int]]) -> list[list[int]]:
    """HF transformers (+ PEFT with ``adapter``), one prompt at a time, fp32 greedy."""
    key = (str(base), None if adapter is None else str(adapter), tuple(map(tuple, prompts)))
    if key not in _HF:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        if adapter is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, adapter)
        model.eval()
        outs = []
        for p in prompts:
            with torch.no_grad():
                o = model.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                   max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)
            outs.append(o[0, len(p):].tolist())
        _HF[key] = outs
    return _HF[key]


def _requests(adapters: dict[str, Path]) -> list[LoRARequest | None]:
    """Each adapter (ids 1..4) and the base, interleaved."""
    reqs = [LoRARequest(name, i + 1, str(p)) for i, (name, p) in enumerate(adapters.items())]
    return [*reqs, None]


def _expected(base: Path, loras: list[LoRARequest | None], prompts: list[list[int]]) -> list[list[int]]:
    """HF + PEFT's tokens for prompt i run by ``loras[i % len(loras)]``."""
    want: list[list[int]] = [[] for _ in prompts]
    for k, lr in enumerate(loras):
        idx = list(range(k, len(prompts), len(loras)))
        ref = hf_peft_greedy(base, None if lr is None else Path(lr.lora_path), [prompts[i] for i in idx])
        for i, toks in zip(idx, ref):
            want[i] = toks
    return want


def run_mixed(base: Path, loras: list[LoRARequest | None], prompts: list[list[int]],
              **kwargs: object) -> LLM:
    """The prompts (prompt i with ``loras[i % len(loras)]``) in one generate call on an engine
    built with ``kwargs``: asserts HF + PEFT's tokens; returns the engine."""
    llm = LLM(str(base), enable_lora=True, max_lora_rank=16, num_kv_blocks=128, block_size=16,
              dtype="float32", **kwargs)
    per_prompt = [loras[i % len(loras)] for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                        lora_request=per_prompt)
    assert [list(o.outputs[0].token_ids) for o in outs] == _expected(base, loras, prompts)
    return llm


def test_mixed_batch_matches_hf_peft(lora_base: Path, adapters: dict[str, Path]) -> None:
    loras = _requests(adapters)
    prompts = _prompts(10)
    want = _expected(lora_base, loras, prompts)
    base = _expected(lora_base, [None], prompts)
    # every adapter changes some tokens: a delta left out (or applied to the base) would show
    for k, lr in enumerate(loras[:-1]):
        assert any(want[i] != base[i] for i in range(k, len(prompts), len(loras))), lr
    llm = run_mixed(lora_base, loras, prompts, max_loras=4, max_cpu_loras=4)
    # chat takes lora_request too (same path): the rendered prompt with one adapter
    msgs = [{"role": "user", "content": "t5 t6 t7"}]
    tpl = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    got = llm.chat(msgs, GREEDY, use_tqdm=False, chat_template=tpl,
                   lora_request=loras[1])[0].outputs[0].token_ids
    ref = llm.chat(msgs, GREEDY, use_tqdm=False, chat_template=tpl)[0].outputs[0].token_ids
    assert len(got) == MAX_TOKENS and list(got) != list(ref)
    llm.engine.kv.check_integrity()


def test_decode_graphs_record_the_adapters(lora_base: Path, adapters: dict[str, Path]) -> None:
    """Decode steps through the static-buffer path a CUDA graph records (``capture=False``: the
    same padded forward, eagerly, with the "gather" method on CPU; the Triton kernels on CUDA),
    adapters and the base mixed in each step, two slots for four adapters (slots reloaded between
    replays): HF + PEFT's tokens."""
    loras = _requests(adapters)
    prompts = _prompts(10, seed=3)
    llm = LLM(str(lora_base), enable_lora=True, max_lora_rank=16, max_loras=2, num_kv_blocks=128,
              block_size=16, dtype="float32", max_num_seqs=8)
    graphs = llm.engine.runner.enable_decode_graphs(capture=False)
    assert graphs.lora is not None
    per_prompt = [loras[i % len(loras)] for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                        lora_request=per_prompt)
    assert [list(o.outputs[0].token_ids) for o in outs] == _expected(lora_base, loras, prompts)
    assert graphs.replays > 0 and llm.engine.runner.lora.num_slot_loads > 4
    llm.engine.kv.check_integrity()


def test_large_steps_take_dense_where_the_adapters_fill_the_slots(
        lora_base: Path, adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A step over DENSE_MAX_TOKENS tokens takes "dense" (on the packed GEMM) where its adapters
    fill at least half of the slots, else "loop"; both give HF + PEFT's tokens."""
    from pagedllm import kernels
    from pagedllm.lora.manager import LoRAManager
    from pagedllm.lora.ops import DENSE_MAX_TOKENS

    seen: list[str] = []
    prepare = LoRAManager.prepare

    def spy(self: LoRAManager, *args: object, **kw: object) -> object:
        mapping = prepare(self, *args, **kw)  # type: ignore[arg-type]
        if mapping is not None and len(mapping.token_slots) > DENSE_MAX_TOKENS:
            seen.append(mapping.method)
        return mapping

    monkeypatch.setattr(LoRAManager, "prepare", spy)
    loras = _requests(adapters)[:2]  # two adapters, one prefill step of 141 tokens
    prompts = [[5 + (7 * i + j) % 90 for i in range(70 + j)] for j in range(2)]
    run_mixed(lora_base, loras, prompts, max_loras=2)  # two of two slots
    assert seen == ["dense" if kernels.available() else "loop"]
    seen.clear()
    run_mixed(lora_base, loras, prompts, max_loras=8)  # two of eight
    assert seen == ["loop"]


def test_decoder_layer_ops_add_the_deltas_with_the_modules_bits(
        lora_base: Path, adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps with adapters run the two decoder-layer ops, which add each linear's deltas
    themselves (kernels/csrc/decoder_layer.cpp add_lora_: the "dense" method's ops in its
    order): tokens and logprobs bitwise equal to the modules called one by one."""
    from pagedllm import kernels
    from pagedllm.models.llama import LlamaDecoderLayer

    if not kernels.available():
        pytest.skip(f"CPU kernels unavailable: {kernels.unavailable_reason()}")
    fused_with_lora: list[int] = []
    real = LlamaDecoderLayer._forward_ops

    def counted(self: LlamaDecoderLayer, *a: object) -> object:
        fused_with_lora.append(a[5].lora is not None)  # type: ignore[attr-defined]
        return real(self, *a)  # type: ignore[arg-type]

    monkeypatch.setattr(LlamaDecoderLayer, "_forward_ops", counted)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
    loras, prompts = _requests(adapters), _prompts(10, seed=3)
    per_prompt = [loras[i % len(loras)] for i in range(len(prompts))]
    got = {}
    for fused in (True, False):
        llm = LLM(str(lora_base), enable_lora=True, max_loras=4, max_lora_rank=16,
                  num_kv_blocks=128, block_size=16, dtype="float32", fused_layers=fused)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                            lora_request=per_prompt)
        got[fused] = [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]
        assert any(fused_with_lora) == fused
        fused_with_lora.clear()
    assert got[True] == got[False]


def test_max_loras_one_many_adapters_correct(lora_base: Path, adapters: dict[str, Path]) -> None:
    """Four adapters and the base through one slot (and a 2-adapter host cache): every request
    finishes with HF + PEFT's tokens; the slot was reloaded as the adapters took turns."""
    llm = run_mixed(lora_base, _requests(adapters), _prompts(10), max_loras=1, max_cpu_loras=2)
    runner = llm.engine.executor.driver
    assert runner.lora is not None and runner.lora.num_slot_loads >= 4
    assert len(runner.lora.cpu) <= 2
    llm.engine.kv.check_integrity()


def test_prefix_cache_never_crosses_adapters(lora_base: Path, adapters: dict[str, Path]) -> None:
    a, b = _requests(adapters)[:2]
    llm = LLM(str(lora_base), enable_lora=True, max_loras=2, max_lora_rank=16,
              num_kv_blocks=64, block_size=4, max_model_len=128, dtype="float32")
    prompt = list(range(10, 50))
    first = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False, lora_request=a)
    kv = llm.engine.kv
    assert kv.find_prefix(prompt, lora_extra_keys(a)).num_tokens > 0  # a's blocks are cached
    assert kv.find_prefix(prompt, lora_extra_keys(b)).num_tokens == 0  # not for b
    assert kv.find_prefix(prompt).num_tokens == 0  # nor for the base
    stats0 = llm.get_prefix_cache_stats()
    other = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False, lora_request=b)
    base = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
    assert llm.get_prefix_cache_stats()["hits"] == stats0["hits"]  # no hit for b or the base
    again = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False, lora_request=a)
    assert llm.get_prefix_cache_stats()["hits"] > stats0["hits"]  # a hits its own blocks
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    want = {x: hf_peft_greedy(lora_base, p, [prompt])[0]
            for x, p in (("a", Path(a.lora_path)), ("b", Path(b.lora_path)), ("base", None))}
    assert list(first[0].outputs[0].token_ids) == want["a"]
    assert list(other[0].outputs[0].token_ids) == want["b"]
    assert list(base[0].outputs[0].token_ids) == want["base"]
    kv.check_integrity()


def test_bad_adapters_fail_alone(lora_base: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    """Each bad adapter: a ValueError naming it and the reason, at generate; no block lost, the
    engine keeps serving (a good adapter afterwards gives HF + PEFT's tokens)."""
    from tests.lora.conftest import edited_copy

    good = adapters["attn_r4"]
    key_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    bad = {
        "missing file": (tmp_path / "nothing", "missing file adapter_config.json"),
        "rank": (edited_copy(good, tmp_path / "rank", {"r": 32}), "rank r=32 is over max_lora_rank=16"),
        "dora": (edited_copy(good, tmp_path / "dora", {"use_dora": True}), "DoRA"),
        "shape": (edited_copy(good, tmp_path / "shape", tensors={key_a: torch.zeros(4, 65)}),
                  "do not fit the base model"),
        "embedding": (edited_copy(good, tmp_path / "emb", tensors={
            "base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 512)}),
            "embedding target"),
        "lm_head": (edited_copy(good, tmp_path / "head", tensors={
            "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64),
            "base_model.model.lm_head.lora_B.weight": torch.zeros(512, 4)}),
            "'lm_head' .* is not supported"),
        "half": (edited_copy(good, tmp_path / "half", tensors={key_a: None}), "without its pair"),
    }
    llm = LLM(str(lora_base), enable_lora=True, max_loras=2, max_lora_rank=16,
              num_kv_blocks=64, block_size=16, max_model_len=128, dtype="float32")
    kv = llm.engine.kv
    free = kv.num_free_blocks
    prompt = {"prompt_token_ids": list(range(10, 30))}
    for i, (name, (path, why)) in enumerate(bad.items()):
        lr = LoRARequest(f"bad-{name}", 10 + i, str(path))
        with pytest.raises(ValueError, match=f"bad-{name}.*{why}"):
            llm.generate([prompt, prompt], GREEDY, use_tqdm=False, lora_request=[None, lr])
        assert kv.num_free_blocks == free and not llm.engine.scheduler.requests
    ok = LoRARequest("good", 1, str(good))
    with pytest.raises(ValueError, match="already adapter 'good'"):  # one id, two adapters
        llm.generate([prompt, prompt], GREEDY, use_tqdm=False,
                     lora_request=[ok, LoRARequest("x", 1, "/y")])
    assert kv.num_free_blocks == free and not llm.engine.scheduler.requests
    out = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=ok)
    assert list(out[0].outputs[0].token_ids) == hf_peft_greedy(lora_base, good, [prompt["prompt_token_ids"]])[0]
    kv.check_integrity()


def test_lora_request_needs_enable_lora(lora_base: Path, adapters: dict[str, Path]) -> None:
    llm = LLM(str(lora_base), num_kv_blocks=32, max_model_len=128)
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate("t5 t6", GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("a", 1, str(adapters["attn_r4"])))


@pytest.mark.parametrize("spec", ["ngram", "draft_model"])
def test_speculative_decoding_with_adapters_matches_hf_peft(lora_base: Path, adapters: dict[str, Path],
                                                            spec: str) -> None:
    """The target verifies proposals with each request's adapter (the step's rows carry the
    proposals, the adapter mapping covers them); proposals come from n-gram lookup or from a
    draft model run without adapters (fewer accepted, never a wrong token)."""
    cfg = ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
           if spec == "ngram" else {"model": str(lora_base), "num_speculative_tokens": 3})
    cfg["disable_by_batch_size"] = 64  # propose at this batch size too
    prompts = [p * 3 for p in _prompts(10, seed=3)]  # repeats: n-gram lookup finds proposals
    llm = run_mixed(lora_base, _requests(adapters), prompts, max_loras=4, max_cpu_loras=4,
                    speculative_config=cfg)
    stats = llm.kv_stats()
    assert stats["spec_decode_num_draft_tokens"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    llm.engine.kv.check_integrity()


def test_tensor_parallel_adapters_match_hf_peft(lora_base: Path, adapters: dict[str, Path]) -> None:
    """TP=2 with a mixed batch of four adapters and the base: each rank holds its shard of every
    adapter (B's rows of qkv / gate_up, A's columns of o / down, whose partial ``A x`` the ranks
    sum), in its own KV pages; tokens equal HF + PEFT."""
    llm = run_mixed(lora_base, _requests(adapters), _prompts(10), max_loras=2, max_cpu_loras=4,
                    tensor_parallel_size=2)
    assert llm.kv_stats()["lora_page_ins"] == 4
    llm.engine.kv.check_integrity()
