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


def test_bench_throughput_with_speculation_on_code(tmp_path: Path,
                                                   capsys: object) -> None:
    """A speculating variant (its JSON holds commas) beside the plain engine on the code
    workload: its row carries the run's proposals and acceptance, printed too."""
    from pagedllm.config import default_model_path

    out = tmp_path / "tp.json"
    variant = ('pagedllm[speculative_config={"method": "ngram", "num_speculative_tokens": 3},'
               'max_num_seqs=4]')
    assert main(["bench", "throughput", "--model", default_model_path(), "--backends",
                 f"pagedllm,{variant}", "--workload", "code", "--num-prompts", "4",
                 "--input-len", "96", "--output-len", "24", "--reps", "1", "--warmup", "1",
                 "--no-plot", "--output-dir", str(tmp_path), "--output-json", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = {r["backend"]: r for r in res["results"]}
    assert list(rows) == ["pagedllm", variant] and "spec_num_draft_tokens" not in rows["pagedllm"]
    on = rows[variant]
    assert 0 < on["spec_num_accepted_tokens"] <= on["spec_num_draft_tokens"]
    assert on["spec_acceptance_rate"] == on["spec_num_accepted_tokens"] / on["spec_num_draft_tokens"]
    assert res["workload"]["kind"] == "code" and res["workload"]["prompt_lens"]["max"] == 96
    assert res["greedy_output_agreement"][f"pagedllm/{variant}"] == 1.0
    assert "speculation accepted" in capsys.readouterr().out  # type: ignore[attr-defined]
