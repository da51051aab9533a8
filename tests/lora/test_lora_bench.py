"""``pagedllm bench throughput --lora-adapters N``: random adapters in PEFT's format
(pagedllm/lora/random.py), the base and a LoRA engine side by side in one run."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pagedllm.config import ModelConfig
from pagedllm.entrypoints.cli import main
from pagedllm.lora.random import write_random_adapter


def test_random_adapter_is_a_peft_adapter_the_engine_runs_as_hf_peft(lora_base: Path,
                                                                       tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM, LoRARequest, SamplingParams

    path = write_random_adapter(ModelConfig.from_hf(str(lora_base), "float32"), tmp_path / "a", 8, 3)
    hf = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(lora_base, dtype=torch.float32),
                                   path).eval()
    prompt = [5, 9, 17, 33, 65, 129]
    with torch.no_grad():
        want = hf.generate(input_ids=torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                           attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                           eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    llm = LLM(str(lora_base), enable_lora=True, max_lora_rank=8, num_kv_blocks=32, block_size=16,
              dtype="float32", max_model_len=128)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False,
                       lora_request=LoRARequest("r", 1, str(path)))[0].outputs[0].token_ids
    assert list(got) == want


def test_bench_throughput_lora_adapters_beside_the_base(lora_base: Path, tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    lora = "pagedllm[enable_lora=true,max_loras=4]"
    assert main(["bench", "throughput", "--model", str(lora_base), "--backends", f"pagedllm,{lora}",
                 "--lora-adapters", "4", "--max-lora-rank", "8", "--workload", "fixed",
                 "--num-prompts", "8", "--input-len", "12", "--output-len", "6", "--max-model-len",
                 "64", "--reps", "1", "--warmup", "0", "--output-dir", str(tmp_path),
                 "--output-json", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = {r["backend"]: r for r in res["results"]}
    assert res["workload"]["lora_adapters"] == 4 and rows[lora]["output_tokens"] == 48
    assert res["greedy_output_agreement"][f"pagedllm/{lora}"] < 0.5  # the adapters change tokens
    assert main(["bench", "throughput", "--model", str(lora_base), "--backends", "pagedllm,hf",
                 "--lora-adapters", "4"]) == 2  # no backend with LoRA, and hf
