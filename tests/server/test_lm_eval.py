"""lm-eval's ``local-completions`` model, unchanged, against ``pagedllm serve``: a multiple-choice
task and a ``loglikelihood_rolling`` task, written to tmp_path (no download). Every per-token
logprob the server returned to lm-eval must equal HF transformers' on the same weights (1e-4).

The served model has the shipped byte-level BPE tokenizer, so words split into several ids; the
expected values come from the exact ids lm-eval sent (recorded by a spy on its parser), never from
hard-coded ids."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from serve_process import serve_process

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e '.[eval]')")

pytestmark = pytest.mark.slow  # ~1 min on 2 cores: lm-eval's import and two evaluations

QUESTIONS = [
    {"question": "The sky on a clear day is", "choices": ["blue", "green", "made of cheese"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["four", "five"], "answer": 0},
    {"question": "Water freezes at zero degrees", "choices": ["Celsius", "Fahrenheit", "Kelvin"],
     "answer": 0},
]
TEXTS = [
    {"text": "A paged KV cache stores keys and values in fixed-size blocks."},
    {"text": "Continuous batching adds new requests between steps; nothing waits for a batch."},
]


def _write_tasks(root: Path) -> Path:
    """Two lm-eval task YAMLs over local jsonl files (HF datasets' ``json`` builder)."""
    for name, rows in (("mc", QUESTIONS), ("text", TEXTS)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "tiny_mc.yaml").write_text(f"""\
task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
""")
    (root / "tiny_ppl.yaml").write_text(f"""\
task: tiny_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / "text.jsonl"}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""")
    return root


def _record_parsed_responses(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[int], int, dict[str, Any]]]:
    """Wrap lm-eval's response parser: every (ids sent, context length, choice returned)."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    seen: list[tuple[list[int], int, dict[str, Any]]] = []
    parse = LocalCompletionsAPI.parse_logprobs

    def spy(outputs: Any, tokens: Any = None, ctxlens: Any = None, **kwargs: Any) -> Any:
        outs = outputs if isinstance(outputs, list) else [outputs]
        choices = [c for out in outs for c in sorted(out["choices"], key=lambda c: c["index"])]
        seen.extend(zip(tokens, ctxlens, choices))
        return parse(outputs=outputs, tokens=tokens, ctxlens=ctxlens, **kwargs)

    monkeypatch.setattr(LocalCompletionsAPI, "parse_logprobs", staticmethod(spy))
    return seen


def test_lm_eval_loglikelihood_tasks_match_hf(bpe_model: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    seen = _record_parsed_responses(monkeypatch)
    tasks = TaskManager(include_path=str(_write_tasks(tmp_path)))
    with serve_process(str(bpe_model), "--served-model-name", "tiny", "--dtype", "float32",
                       "--max-model-len", "256") as (_, base):
        out = lm_eval.simple_evaluate(
            model="local-completions", tasks=["tiny_mc", "tiny_ppl"], task_manager=tasks,
            model_args={"model": "tiny", "base_url": base + "/v1/completions",
                        "tokenizer": str(bpe_model), "tokenizer_backend": "huggingface",
                        "max_length": 256},
            log_samples=True, bootstrap_iters=0)
    assert out is not None
    results = out["results"]
    assert 0.0 <= results["tiny_mc"]["acc,none"] <= 1.0
    assert math.isfinite(results["tiny_ppl"]["word_perplexity,none"])
    # every (context, choice) pair and every rolling window reached the server and came back
    n_choices = sum(len(q["choices"]) for q in QUESTIONS)
    assert len(seen) == n_choices + len(TEXTS)  # one window per (short) text

    hf = AutoModelForCausalLM.from_pretrained(bpe_model, dtype=torch.float32).eval()
    sums = {"mc": [], "rolling": []}  # HF's log-likelihood of each continuation lm-eval asked for
    for ids, ctxlen, choice in seen:
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1  # the prompt, echoed, + 1 generated
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
        assert lp["token_logprobs"][0] is None
        for i in range(1, len(ids)):  # the whole prompt, not only the part lm-eval sums
            assert lp["token_logprobs"][i] == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-4)
            assert max(lp["top_logprobs"][i].values()) == pytest.approx(ref[i - 1].max().item(),
                                                                         abs=1e-4)
        # a rolling window's context is the one prefix token; a question is longer
        sums["rolling" if ctxlen == 1 else "mc"].append(
            sum(ref[i - 1, ids[i]].item() for i in range(ctxlen, len(ids))))

    # what lm-eval reports is HF's, summed: per choice, and per text over its windows
    got_mc = sorted(r[0][0] for s in out["samples"]["tiny_mc"] for r in s["resps"])
    assert got_mc == pytest.approx(sorted(sums["mc"]), abs=1e-3)
    got_rolling = sum(s["resps"][0][0] for s in out["samples"]["tiny_ppl"])
    assert got_rolling == pytest.approx(sum(sums["rolling"]), abs=1e-3)
