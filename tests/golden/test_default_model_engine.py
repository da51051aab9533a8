"""The engine on the shipped default model against HF transformers on the same weights."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import default_model_path

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n", '"""Return the ', "class Stack:\n    def "]
NEW = 24


@pytest.mark.slow
def test_default_model_greedy_and_prompt_logprobs_match_hf() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM()  # no model argument: the shipped default
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert len(outs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            gen = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False,
                              eos_token_id=None, pad_token_id=tok.pad_token_id,
                              output_logits=True, return_dict_in_generate=True)
            ref_prompt = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
        hf_new = gen.sequences[0, len(ids):].tolist()
        assert len(hf_new) == NEW and len(out.outputs) == 1
        comp = out.outputs[0]
        assert comp.token_ids == hf_new, (prompt, comp.text, tok.decode(hf_new))
        assert comp.text == tok.decode(hf_new)
        hf_lp = torch.cat(gen.logits).log_softmax(-1)
        assert comp.logprobs is not None and len(comp.logprobs) == NEW
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids)
        for i, t in enumerate(hf_new):
            assert abs(comp.logprobs[i][t].logprob - hf_lp[i, t].item()) < 1e-4
        for i in range(1, len(ids)):
            assert abs(out.prompt_logprobs[i][ids[i]].logprob - ref_prompt[i - 1, ids[i]].item()) < 1e-4
