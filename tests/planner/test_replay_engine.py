"""The planner's replay is the engine core's own step on a simulated executor
(``pagedllm.executor.simulated``). Fed the tokens a real run generated, it takes that run's steps,
preemptions, peak running and speculation: n-gram speculative decoding, n > 1 and preemption
together."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from engine_checks import repetitive_prompts

from pagedllm.args import EngineArgs
from pagedllm.bench.workload import BenchRequest
from pagedllm.entrypoints.cli import main
from pagedllm.planner.replay import replay, summarize
from pagedllm.sampling_params import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1, "min_acceptance_rate": 0.0, "disable_by_batch_size": None}
# a pool of 40 blocks of 4 tokens for 8 running sequences of up to ~70 tokens: it preempts
ENGINE = {"max_model_len": 128, "block_size": 4, "num_kv_blocks": 40, "max_num_seqs": 8,
          "max_num_batched_tokens": 48}


def _params(i: int) -> SamplingParams:
    if i % 3 == 0:  # n = 3 seeded sampled sequences; they speculate too
        return SamplingParams(n=3, temperature=1.0, seed=i, max_tokens=20, ignore_eos=True)
    return SamplingParams(temperature=0.0, max_tokens=16 + 3 * i, ignore_eos=True)


def _real_run(kw: dict[str, Any], prompts: list[list[int]]) -> tuple[dict[str, Any], list[Any]]:
    """The engine on a model: its steps, preemptions, peak running and speculation, and each
    request's sequences' tokens."""
    from pagedllm.engine import LLMEngine

    engine = LLMEngine.from_args(**kw)
    for i, p in enumerate(prompts):
        engine.add_request(f"q{i}", {"prompt_token_ids": p}, _params(i))
    steps = peak = 0
    tokens: dict[str, list[list[int]]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = [o.token_ids for o in sorted(out.outputs,
                                                                      key=lambda o: o.index)]
        steps += 1
        peak = max(peak, engine.stats.batch_running)
    s = engine.kv_stats()
    real = {"num_steps": steps, "num_preemptions": engine.num_preemptions, "peak_running": peak,
            "output_tokens": sum(len(t) for seqs in tokens.values() for t in seqs),
            "spec_num_draft_tokens": s["spec_decode_num_draft_tokens"],
            "spec_num_accepted_tokens": s["spec_decode_num_accepted_tokens"]}
    engine.shutdown()
    return real, [tokens[f"q{i}"] for i in range(len(prompts))]


def test_replay_of_a_recorded_run_equals_the_engine(tiny_models: dict[str, Path]) -> None:
    kw = {"model": str(tiny_models["llama"]), **ENGINE, "speculative_config": NGRAM}
    prompts = repetitive_prompts(10, seed=3)
    real, tokens = _real_run(kw, prompts)
    assert real["num_preemptions"] > 0  # the pool is small enough to preempt
    assert 0 < real["spec_num_accepted_tokens"] < real["spec_num_draft_tokens"]
    reqs = [BenchRequest(p, _params(i).max_tokens, n=_params(i).n, output_token_ids=tokens[i])
            for i, p in enumerate(prompts)]
    plan = summarize(replay(reqs, EngineArgs.from_kwargs(kw).create_engine_config()))
    assert {k: plan[k] for k in real} == real


def test_stand_ins_never_match_a_proposal_and_n_counts_every_sequence(
        tiny_models: dict[str, Path]) -> None:
    """Without recorded tokens the n-gram lookup finds nothing in the outputs: speculation
    proposes from the prompt at most, and no proposal is accepted."""
    kw = {"model": str(tiny_models["llama"]), **ENGINE, "speculative_config": NGRAM}
    reqs = [BenchRequest(p, 12, n=2 if i % 2 else 1) for i, p in enumerate(repetitive_prompts(6, seed=5))]
    res = replay(reqs, EngineArgs.from_kwargs(kw).create_engine_config())
    assert res.spec is not None and res.spec.num_accepted_tokens == 0
    assert res.num_output == [12 * r.n for r in reqs] and res.longest_output == [12] * 6


def test_a_sequence_ends_where_its_recorded_tokens_end(tiny_models: dict[str, Path]) -> None:
    """A recorded sequence shorter than max_tokens (a stop string ended it) stops there, as the
    front end's abort stops it; its sibling runs on."""
    kw = {"model": str(tiny_models["llama"]), **ENGINE}
    req = BenchRequest([5, 6, 7, 8], 10, n=2, output_token_ids=[[9, 10, 11], list(range(20, 30))])
    res = replay([req], EngineArgs.from_kwargs(kw).create_engine_config())
    assert res.num_output == [3 + 10] and res.longest_output == [10]


def test_recorded_outputs_must_match_n_and_draft_models_are_refused(
        tiny_models: dict[str, Path]) -> None:
    cfg = EngineArgs.from_kwargs({"model": str(tiny_models["llama"]), **ENGINE}).create_engine_config()
    with pytest.raises(ValueError, match="2 recorded outputs for n=3"):
        replay([BenchRequest([5, 6], 4, n=3, output_token_ids=[[1], [2]])], cfg)
    draft = {"model": str(tiny_models["llama"]), **ENGINE,
             "speculative_config": {"method": "draft_model", "model": str(tiny_models["llama"]),
                                    "num_speculative_tokens": 2}}
    with pytest.raises(ValueError, match="draft model"):
        replay([BenchRequest([5, 6], 4)], EngineArgs.from_kwargs(draft).create_engine_config())


def test_bench_records_a_trace_that_the_plan_replays_exactly(tmp_path: Path) -> None:
    """``bench throughput --record-trace`` on the shipped model with n-gram speculation on code
    (its prompt lookup pays), in a pool small enough to preempt; ``plan --trace`` of that file
    gives the run's steps, preemptions, peak running and accepted proposals."""
    import torch

    engine = ["--block-size", "8", "--num-kv-blocks", "28", "--max-model-len", "160",
              "--max-num-seqs", "8", "--max-num-batched-tokens", "96",
              "--speculative-config", json.dumps({**NGRAM, "num_speculative_tokens": 4})]
    trace, bench_json, plan_json = tmp_path / "t.jsonl", tmp_path / "b.json", tmp_path / "p.json"
    threads = torch.get_num_threads()
    try:
        assert main(["bench", "throughput", "--backends", "pagedllm", "--reps", "1", "--warmup",
                     "0", "--no-plot", "--threads", "1", "--output-dir", str(tmp_path),
                     "--output-json", str(bench_json), "--record-trace", str(trace),
                     "--workload", "code", "--num-prompts", "12", "--input-len", "64",
                     "--output-len", "40", *engine]) == 0
    finally:
        torch.set_num_threads(threads)
    assert main(["plan", "--workload", "trace", "--trace", str(trace), *engine,
                 "--output-json", str(plan_json)]) == 0
    real = json.loads(bench_json.read_text())["results"][0]
    plan = json.loads(plan_json.read_text())
    keys = ("num_steps", "num_preemptions", "peak_running", "output_tokens",
            "spec_num_draft_tokens", "spec_num_accepted_tokens")
    assert {k: plan[k] for k in keys} == {k: real[k] for k in keys}
    assert real["num_preemptions"] > 0 and real["spec_num_accepted_tokens"] > 0
