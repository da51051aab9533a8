"""N-gram speculation through the engine: greedy (and seeded sampled) outputs identical to the
engine without speculation, token for token and logprob for logprob, while proposals are both
accepted and rejected; KV integrity after every step and every block back at the end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_checks import (
    assert_same_completion,
    audit_kv_moves,
    repetitive_prompts,
    step_until_idle,
)

from pagedllm import LLM, SamplingParams
from pagedllm.engine import LLMEngine

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1, "min_acceptance_rate": 0.0, "disable_by_batch_size": None}
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=0)
# Verification runs k + 1 query rows through the prefill attention path where a plain decode
# runs the decode kernel: fp32 summation order only. Measured max |Δ| 3e-6 on these prompts.
LP_TOL = 2e-5


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
        after_step: Any = None) -> dict[str, Any]:
    """Add ``prompts`` as q0, q1, ...; step until idle with ``check_integrity()`` after every
    step; request id -> its finished outputs. Every block is back in the pool at the end."""
    cb = None if after_step is None else (lambda _step: after_step(engine))
    done = step_until_idle(engine, prompts, params, cb, max_steps=3000)
    assert len(done) == len(prompts)
    engine.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks, "a block was not returned"
    return done


def same_outputs(got: dict[str, Any], want: dict[str, Any], tol: float = LP_TOL) -> None:
    assert len(got) == len(want) > 0
    for rid in want:
        assert len(got[rid]) == len(want[rid])
        for g, w in zip(got[rid], want[rid]):
            assert_same_completion(g, w, tol, rid)


def spec_counts(engine: LLMEngine) -> tuple[int, int]:
    s = engine.kv_stats()
    return s["spec_decode_num_draft_tokens"], s["spec_decode_num_accepted_tokens"]


def assert_accepts_and_rejects(engine: LLMEngine) -> None:
    drafted, accepted = spec_counts(engine)
    assert 0 < accepted < drafted, f"accepted {accepted} of {drafted}: both paths must run"


SLOW = pytest.mark.slow  # the other architectures and paths: same code, the slow suite runs them


@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen2", marks=SLOW),
                                  pytest.param("mistral", marks=SLOW)])
@pytest.mark.parametrize("block_size", [1, 16])
def test_greedy_identical_with_ngram(tiny_models: dict[str, Path], arch: str,
                                     block_size: int) -> None:
    prompts = repetitive_prompts(6, seed=block_size)
    kw = dict(model=str(tiny_models[arch]), block_size=block_size, num_kv_blocks=4096 // block_size,
              max_model_len=128)
    want = run(LLM(**kw).engine, prompts, GREEDY)
    eng = LLM(**kw, speculative_config=NGRAM).engine
    got = run(eng, prompts, GREEDY)
    same_outputs(got, want)
    assert_accepts_and_rejects(eng)


def _llm(tiny_models: dict[str, Path], spec: bool, **kw: Any) -> LLM:
    args: dict[str, Any] = dict(model=str(tiny_models["llama"]), block_size=4, num_kv_blocks=512,
                                max_model_len=128)
    args.update(kw)
    return LLM(**args, speculative_config=NGRAM if spec else None)


@pytest.fixture(scope="module")
def reference(tiny_models: dict[str, Path]) -> dict[str, Any]:
    """Greedy outputs of 12 prompts on the plain engine (roomy pool, no prefix caching)."""
    prompts = repetitive_prompts(12, seed=7)
    return run(_llm(tiny_models, False, enable_prefix_caching=False).engine, prompts, GREEDY)


@pytest.mark.parametrize("mode", ["recompute", pytest.param("swap", marks=SLOW)])
def test_preemption_keeps_greedy_outputs(tiny_models: dict[str, Path], reference: dict,
                                         mode: str) -> None:
    # 40 blocks of 4 tokens for 12 requests of up to 72 tokens: preemption is certain
    llm = _llm(tiny_models, True, num_kv_blocks=40, max_num_batched_tokens=48, swap_space=0.002,
               preemption_mode=mode, reserved_fraction=0.0)
    eng = llm.engine
    moves = audit_kv_moves(llm)  # every block swapped back in is bit-identical
    got = run(eng, repetitive_prompts(12, seed=7), GREEDY)
    same_outputs(got, reference)
    assert eng.scheduler.preemptions_by_kind[mode] > 0
    assert (moves["swapped_in"] > 0) == (mode == "swap")
    assert_accepts_and_rejects(eng)


def test_prefix_cache_hits_on_blocks_written_by_accepted_proposals(
        tiny_models: dict[str, Path], reference: dict) -> None:
    """The same prompts twice in one engine: the second round hits the blocks the first round
    cached, generated (verified) tokens included; rejected tokens were never cached, so a hit
    that held one would change the outputs."""
    eng = _llm(tiny_models, True).engine
    prompts = repetitive_prompts(12, seed=7)
    same_outputs(run(eng, prompts, GREEDY), reference)
    hits = eng.kv_stats()["prefix_cache_hits"]
    # a prompt that is the first prompt plus its output: its blocks came from verification
    first = reference["q0"][0].token_ids
    longer = prompts[0] + list(first[:20])
    again = run(eng, prompts + [longer], GREEDY)
    same_outputs({k: again[k] for k in reference}, reference)
    assert eng.kv_stats()["prefix_cache_hits"] - hits >= sum(len(p) // 4 * 4 - 4 for p in prompts)
    plain = run(_llm(tiny_models, False, enable_prefix_caching=False).engine, [longer], GREEDY)
    same_outputs({"q0": again["q12"]}, plain)
    assert_accepts_and_rejects(eng)


def test_n_greedy_samples_share_blocks_and_match(tiny_models: dict[str, Path],
                                                 reference: dict) -> None:
    eng = _llm(tiny_models, True).engine
    prompts = repetitive_prompts(12, seed=7)[:6]
    got = run(eng, prompts, GREEDY.clone(n=3))
    for rid, outs in got.items():
        assert len(outs) == 3
        for o in outs:
            assert_same_completion(o, reference[rid][0], LP_TOL, rid)
    assert_accepts_and_rejects(eng)


@SLOW
def test_int8_kv_cache_identical_with_ngram(tiny_models: dict[str, Path]) -> None:
    prompts = repetitive_prompts(6, seed=7)
    want = run(_llm(tiny_models, False, kv_cache_dtype="int8").engine, prompts, GREEDY)
    eng = _llm(tiny_models, True, kv_cache_dtype="int8").engine
    same_outputs(run(eng, prompts, GREEDY), want)
    assert_accepts_and_rejects(eng)


def test_seeded_sampling_identical_with_ngram(tiny_models: dict[str, Path]) -> None:
    """A seeded request draws the same random numbers per kept token as without speculation
    (verify.SeededRewind), so its tokens are the same; unseeded ones in the batch keep it
    honest (they draw from the global generator in the same sampler call)."""
    prompts = repetitive_prompts(6, seed=5)
    params = [SamplingParams(temperature=0.7, top_k=40, top_p=0.95, seed=100 + i, max_tokens=32,
                             ignore_eos=True, logprobs=2) for i in range(5)]
    params.append(SamplingParams(temperature=0.7, max_tokens=32, ignore_eos=True))
    want = run(_llm(tiny_models, False).engine, prompts, params)
    eng = _llm(tiny_models, True).engine
    got = run(eng, prompts, params)
    same_outputs({f"q{i}": got[f"q{i}"] for i in range(5)},
                 {f"q{i}": want[f"q{i}"] for i in range(5)})
    assert len(got["q5"][0].token_ids) == 32
    assert_accepts_and_rejects(eng)


def test_stops_inside_accepted_proposals(tiny_models: dict[str, Path], reference: dict) -> None:
    """Stop tokens, stop strings and max_tokens end a request at the same token as without
    speculation, even when the stop falls among accepted proposals of one step."""
    prompts = repetitive_prompts(12, seed=7)
    params = []
    for i in range(12):
        out = reference[f"q{i}"][0].token_ids
        if i % 3 == 0:
            params.append(GREEDY.clone(stop_token_ids=[out[9 + i]]))
        elif i % 3 == 1:
            params.append(GREEDY.clone(stop=[f" t{out[7 + i]} "], ignore_eos=True))
        else:
            params.append(GREEDY.clone(max_tokens=5 + i))
    want = run(_llm(tiny_models, False).engine, prompts, params)
    eng = _llm(tiny_models, True).engine
    got = run(eng, prompts, params)
    for rid in want:
        g, w = got[rid][0], want[rid][0]
        assert (g.text, list(g.token_ids), g.finish_reason, g.stop_reason) == (
            w.text, list(w.token_ids), w.finish_reason, w.stop_reason), rid
    assert {w[0].finish_reason for w in want.values()} == {"stop", "length"}
    assert_accepts_and_rejects(eng)


def test_proposals_count_against_the_token_budget(tiny_models: dict[str, Path],
                                                  reference: dict) -> None:
    eng = _llm(tiny_models, True, max_num_batched_tokens=10).engine
    seen: list[int] = []
    got = run(eng, repetitive_prompts(12, seed=7), GREEDY,
              after_step=lambda e: seen.append(e.stats.num_scheduled_tokens))
    same_outputs(got, reference)
    assert max(seen) <= 10
    assert_accepts_and_rejects(eng)


def test_greedy_matches_hf_with_ngram(tiny_models: dict[str, Path], reference: dict) -> None:
    """Against the independent reference: HF ``generate`` on the same weights, token for token
    and logprob for logprob (1e-4), for the speculating engine's outputs."""
    import torch
    from transformers import AutoModelForCausalLM

    prompts = repetitive_prompts(12, seed=7)[:4]
    eng = _llm(tiny_models, True).engine
    got = run(eng, prompts, GREEDY)
    hf = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32).eval()
    for i, p in enumerate(prompts):
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=GREEDY.max_tokens, do_sample=False, eos_token_id=None,
                              pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        ids = out.sequences[0, len(p):].tolist()
        lps = torch.cat(out.logits).float().log_softmax(-1)
        c = got[f"q{i}"][0]
        assert list(c.token_ids) == ids, f"q{i}"
        mine = [pos[t].logprob for pos, t in zip(c.logprobs, c.token_ids)]
        want = lps[torch.arange(len(ids)), torch.tensor(ids)].tolist()
        assert max(abs(a - b) for a, b in zip(mine, want)) < 1e-4, f"q{i}"
    assert_accepts_and_rejects(eng)


def test_abort_mid_speculation_returns_every_block(tiny_models: dict[str, Path], tmp_path: Path,
                                                   reference: dict) -> None:
    """Aborts between steps of speculating requests (one right after its proposals were
    verified, one while still prefilling): the others finish unchanged, every block is back,
    and the KV trace (with its rollbacks) replays to the same pool."""
    from pagedllm.kv.trace import load, replay

    path = tmp_path / "kv.jsonl"
    llm = _llm(tiny_models, True, max_num_batched_tokens=24, kv_trace_path=str(path))
    eng = llm.engine
    prompts = repetitive_prompts(12, seed=7)
    for i, p in enumerate(prompts):
        eng.add_request(f"q{i}", {"prompt_token_ids": p}, GREEDY)
    done: dict[str, Any] = {}
    aborted: set[str] = set()
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs
        eng.check_integrity()
        if eng.stats.spec.num_drafts and not aborted:
            verifying = next(r.request_id for r in eng.scheduler.running
                             if r.num_output_tokens > 1)
            prefilling = next((r.request_id for r in eng.scheduler.running
                               if r.num_computed_tokens < r.num_prompt_tokens), None)
            aborted = {verifying, prefilling} - {None}  # type: ignore[assignment]
            for rid in aborted:
                assert eng.abort_request(rid)
            eng.check_integrity()
    assert set(done) == {f"q{i}" for i in range(12)} - aborted and aborted
    same_outputs(done, {k: reference[k] for k in done})
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    assert_accepts_and_rejects(eng)
    eng.shutdown()
    assert any(e["op"] == "rollback" for e in load(path))
    kv = replay(path)
    assert kv.num_free_blocks == kv.num_blocks == eng.kv.num_blocks


def test_metrics_count_drafts_and_accepts(tiny_models: dict[str, Path]) -> None:
    from pagedllm.engine.client_inproc import InProcessClient
    from pagedllm.server.metrics import ServerMetrics

    llm = _llm(tiny_models, True)
    eng = llm.engine
    steps: list[Any] = []
    run(eng, repetitive_prompts(4, seed=7), GREEDY, after_step=lambda e: steps.append(e.stats))
    s = eng.kv_stats()
    assert s["spec_decode_num_drafts"] == sum(st.spec.num_drafts for st in steps) > 0
    assert s["spec_decode_num_draft_tokens"] == sum(st.spec.num_draft_tokens for st in steps)
    assert s["spec_decode_num_accepted_tokens"] == sum(st.spec.num_accepted_tokens for st in steps)
    assert s["spec_decode_acceptance_rate"] == pytest.approx(
        s["spec_decode_num_accepted_tokens"] / s["spec_decode_num_draft_tokens"])
    assert s["spec_decode_mean_accepted_length"] == pytest.approx(
        1 + s["spec_decode_num_accepted_tokens"] / s["spec_decode_num_drafts"])
    # every output token is either accepted or the target's own, one of those per sampling row
    assert sum(st.num_generation_tokens for st in steps) == 4 * GREEDY.max_tokens
    text = ServerMetrics(InProcessClient(eng), "m").render().decode()
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert f'pagedllm:spec_decode_{key}_total{{engine="0",model_name="m"}} {float(s["spec_decode_" + key])}' in text
    plain = _llm(tiny_models, False).engine
    assert "spec_decode" not in ServerMetrics(InProcessClient(plain), "m").render().decode()
    assert plain.spec is None and plain.kv_stats()["spec_decode_num_drafts"] == 0


def test_sliding_window_model_frees_and_rolls_back(make_model: Any) -> None:
    """A windowed Mistral (window 12, blocks of 4) in a tight pool: blocks leave the window at the
    front while rejected proposals roll back at the back; outputs as without speculation."""
    path = make_model("mistral", sliding_window=12)
    kw = dict(model=str(path), block_size=4, num_kv_blocks=48, max_model_len=128,
              max_num_batched_tokens=32, reserved_fraction=0.0)
    prompts = repetitive_prompts(8, seed=7)
    want = run(LLM(**kw).engine, prompts, GREEDY)
    eng = LLM(**kw, speculative_config=NGRAM).engine
    got = run(eng, prompts, GREEDY)
    same_outputs(got, want)
    assert eng.kv_stats()["window_freed_blocks"] > 0
    assert_accepts_and_rejects(eng)
