"""``pagedllm bench latency``: speculation on vs off side by side, on a tiny random model."""

from __future__ import annotations

import json
from pathlib import Path

from pagedllm.entrypoints.cli import main


def test_bench_latency_cli(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "latency.json"
    spec = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None,
            "min_acceptance_rate": 0.0}
    assert main(["bench", "latency", "--model", str(tiny_models["llama"]), "--random-prompts",
                 "--batch-sizes", "1,2", "--prompt-len", "12", "--output-len", "12", "--reps", "2",
                 "--max-model-len", "64", "--block-size", "4", "--speculative-config",
                 json.dumps(spec), "--no-plot", "--output-dir", str(tmp_path),
                 "--output-json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["benchmark"] == "latency" and res["speculative_config"]["num_speculative_tokens"] == 3
    rows = res["results"]
    assert [(r["batch"], r["speculation"]) for r in rows] == [(1, "off"), (1, "on"), (2, "off"),
                                                              (2, "on")]
    for r in rows:
        assert r["output_tokens_per_s"] > 0 and len(r["elapsed_s_all"]) == 2
    for off, on in zip(rows[::2], rows[1::2]):
        assert off["num_draft_tokens"] == 0 < on["num_draft_tokens"]
        assert on["ratio_output"] == on["output_tokens_per_s"] / off["output_tokens_per_s"]
    assert res["greedy_output_agreement"] == {"1": 1.0, "2": 1.0}


def test_code_prompts_come_from_the_heldout_split() -> None:
    from pagedllm.bench.latency import code_prompts
    from pagedllm.config import default_model_path
    from pagedllm.tokenizer import get_tokenizer

    tok = get_tokenizer(default_model_path())
    ps = code_prompts(tok, 3, 64)
    assert len(ps) == 3 and all(len(p) == 64 for p in ps) and ps[0] != ps[1]
