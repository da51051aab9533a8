"""Draft-model speculation through the engine: greedy (and seeded sampled) outputs identical to
the engine without speculation, with the draft's own KV pool checked after every step
(``engine.check_integrity`` covers it) and every block of both pools back at the end.

Drafts: a truncated-layers copy of the target (smaller, agrees with it often but not always:
proposals are both accepted and rejected) and the target itself (acceptance ~100 %)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_ngram_engine import (
    GREEDY,
    assert_accepts_and_rejects,
    repetitive_prompts,
    same_outputs,
    spec_counts,
)
from test_ngram_engine import run as run_target

from pagedllm import LLM, SamplingParams
from pagedllm.engine import LLMEngine
from pagedllm.spec_decode.draft import DraftProposer
from pagedllm.spec_decode.truncate import truncate_layers

SLOW = pytest.mark.slow


def draft_config(path: Path, **kw: Any) -> dict[str, Any]:
    return {"model": str(path), "num_speculative_tokens": 3, "min_acceptance_rate": 0.0,
            "disable_by_batch_size": None, **kw}


def draft_of(engine: LLMEngine) -> DraftProposer:
    assert engine.spec is not None
    proposer = engine.spec.proposer
    assert isinstance(proposer, DraftProposer)
    return proposer


def run(engine: LLMEngine, prompts: list[list[int]], params: Any, after_step: Any = None
        ) -> dict[str, Any]:
    """``test_ngram_engine.run`` (integrity after every step, every target block back), and
    every block of the draft's pool back too."""
    done = run_target(engine, prompts, params, after_step)
    if engine.spec is not None:
        d = draft_of(engine)
        assert d.kv.num_free_blocks == d.kv.num_blocks, "a draft block was not returned"
        assert d.kv.num_requests == 0 and not d._base
    return done


def record_proposals(engine: LLMEngine) -> list[tuple[list[int], list[int]]]:
    """Every (context, proposal) the draft makes from now on (a live list)."""
    draft = draft_of(engine)
    seen: list[tuple[list[int], list[int]]] = []
    propose = draft.propose

    def spy(requests: list[Any], ks: list[int]) -> list[list[int]]:
        out = propose(requests, ks)
        seen.extend((list(r.token_ids), p) for r, p in zip(requests, out) if p)
        return out

    draft.propose = spy  # type: ignore[method-assign]
    return seen


def assert_draft_greedy(draft: Path, seen: list[tuple[list[int], list[int]]],
                        block_size: int = 4) -> None:
    """Each proposal is the draft model's own greedy continuation of its context, computed by a
    plain engine from scratch: so the draft's KV (rolled back, hit, recomputed) was right."""
    assert seen
    llm = LLM(model=str(draft), block_size=block_size, num_kv_blocks=8192 // block_size,
              max_model_len=160, enable_prefix_caching=False)
    outs = llm.generate([{"prompt_token_ids": c} for c, _ in seen],
                        [GREEDY.clone(max_tokens=len(p), logprobs=None) for _, p in seen],
                        use_tqdm=False)
    bad = [i for i, (o, (_, p)) in enumerate(zip(outs, seen)) if list(o.outputs[0].token_ids) != p]
    assert not bad, f"{len(bad)} of {len(seen)} proposals are not the draft's greedy tokens"


@pytest.fixture(scope="module")
def drafts(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
           ) -> dict[str, Path]:
    """arch -> the first layer of ``tiny_models[arch]`` (2 layers) as a draft."""
    root = tmp_path_factory.mktemp("drafts")
    return {a: truncate_layers(p, root / a, 1) for a, p in tiny_models.items()}


@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen2", marks=SLOW),
                                  pytest.param("mistral", marks=SLOW)])
@pytest.mark.parametrize("block_size", [1, 16])
def test_greedy_identical_with_a_smaller_draft(tiny_models: dict[str, Path],
                                               drafts: dict[str, Path], arch: str,
                                               block_size: int) -> None:
    prompts = repetitive_prompts(6, seed=block_size)
    kw = dict(model=str(tiny_models[arch]), block_size=block_size,
              num_kv_blocks=4096 // block_size, max_model_len=128)
    want = run(LLM(**kw).engine, prompts, GREEDY)
    eng = LLM(**kw, speculative_config=draft_config(drafts[arch])).engine
    assert draft_of(eng).runner.model.config.num_hidden_layers == 1
    seen = record_proposals(eng)
    same_outputs(run(eng, prompts, GREEDY), want)
    assert_accepts_and_rejects(eng)
    assert_draft_greedy(drafts[arch], seen, block_size)


@pytest.mark.parametrize("block_size", [1, pytest.param(16, marks=SLOW)])
def test_the_target_as_its_own_draft_accepts_nearly_everything(tiny_models: dict[str, Path],
                                                               block_size: int) -> None:
    path = str(tiny_models["llama"])
    prompts = repetitive_prompts(6, seed=3)
    kw = dict(model=path, block_size=block_size, num_kv_blocks=4096 // block_size,
              max_model_len=128)
    want = run(LLM(**kw).engine, prompts, GREEDY)
    eng = LLM(**kw, speculative_config=draft_config(Path(path))).engine
    same_outputs(run(eng, prompts, GREEDY), want)
    drafted, accepted = spec_counts(eng)
    # near-ties may flip between the draft's decode path and the verification's fp32 order
    assert drafted > 0 and accepted >= 0.97 * drafted, (accepted, drafted)


def _llm(tiny_models: dict[str, Path], drafts: dict[str, Path], spec: bool, **kw: Any) -> LLM:
    args: dict[str, Any] = dict(model=str(tiny_models["llama"]), block_size=4,
                                num_kv_blocks=512, max_model_len=128)
    args.update(kw)
    return LLM(**args, speculative_config=draft_config(drafts["llama"]) if spec else None)


@pytest.fixture(scope="module")
def reference(tiny_models: dict[str, Path]) -> dict[str, Any]:
    prompts = repetitive_prompts(12, seed=7)
    return run(LLM(model=str(tiny_models["llama"]), block_size=4, num_kv_blocks=512,
                   max_model_len=128, enable_prefix_caching=False).engine, prompts, GREEDY)


@pytest.mark.parametrize("mode", ["recompute", pytest.param("swap", marks=SLOW)])
def test_preemption_frees_the_draft_and_keeps_outputs(tiny_models: dict[str, Path],
                                                      drafts: dict[str, Path], reference: dict,
                                                      mode: str) -> None:
    llm = _llm(tiny_models, drafts, True, num_kv_blocks=40, max_num_batched_tokens=48,
               swap_space=0.002, preemption_mode=mode, reserved_fraction=0.0)
    eng = llm.engine
    draft = draft_of(eng)
    freed: list[str] = []
    release = draft.release

    def spy(ids: Any) -> None:
        ids = list(ids)
        freed.extend(ids)
        release(ids)

    draft.release = spy  # type: ignore[method-assign]
    seen = record_proposals(eng)
    got = run(eng, repetitive_prompts(12, seed=7), GREEDY)
    same_outputs(got, reference)
    assert_draft_greedy(drafts["llama"], seen)
    assert eng.scheduler.preemptions_by_kind[mode] > 0
    # a preempted request's draft KV was freed before it finished (released twice: preempted,
    # then finished)
    assert len(freed) > len(set(freed))
    assert_accepts_and_rejects(eng)


def test_draft_prefix_cache_hits_and_n_samples(tiny_models: dict[str, Path],
                                               drafts: dict[str, Path], reference: dict) -> None:
    """The same prompts twice in one engine: the draft's second prefill hits the blocks its
    first round hashed; then n = 3 samples of each (siblings share the draft's prompt blocks)."""
    eng = _llm(tiny_models, drafts, True).engine
    draft = draft_of(eng)
    prompts = repetitive_prompts(12, seed=7)
    same_outputs(run(eng, prompts, GREEDY), reference)
    hits = draft.kv.stats.hits
    seen = record_proposals(eng)
    same_outputs(run(eng, prompts, GREEDY), reference)
    assert draft.kv.stats.hits - hits >= sum((len(p) - 1) // 4 * 4 for p in prompts)
    got = run(eng, prompts[:6], GREEDY.clone(n=3))
    for rid, outs in got.items():
        assert len(outs) == 3
        for o in outs:
            same_outputs({rid: [o]}, {rid: reference[rid]})
    assert_accepts_and_rejects(eng)
    assert_draft_greedy(drafts["llama"], seen)


def test_seeded_sampling_identical_with_a_draft(tiny_models: dict[str, Path],
                                                drafts: dict[str, Path]) -> None:
    prompts = repetitive_prompts(6, seed=5)
    params = [SamplingParams(temperature=0.7, top_k=40, seed=100 + i, max_tokens=24,
                             ignore_eos=True, logprobs=2) for i in range(6)]
    want = run(_llm(tiny_models, drafts, False).engine, prompts, params)
    eng = _llm(tiny_models, drafts, True).engine
    same_outputs(run(eng, prompts, params), want)
    assert_accepts_and_rejects(eng)


def test_a_full_draft_pool_only_proposes_less(tiny_models: dict[str, Path],
                                              drafts: dict[str, Path], reference: dict) -> None:
    """A draft pool of 24 blocks for 12 requests of up to 23 blocks: most requests find no room
    in it and decode plainly; the outputs do not change."""
    llm = LLM(model=str(tiny_models["llama"]), block_size=4, num_kv_blocks=512, max_model_len=128,
              speculative_config=draft_config(drafts["llama"], draft_num_kv_blocks=24))
    eng = llm.engine
    assert draft_of(eng).kv.num_blocks == 24
    same_outputs(run(eng, repetitive_prompts(12, seed=7), GREEDY), reference)
    drafted, accepted = spec_counts(eng)
    assert 0 < drafted < 12 * GREEDY.max_tokens


def test_abort_returns_every_draft_block(tiny_models: dict[str, Path], drafts: dict[str, Path],
                                         reference: dict) -> None:
    eng = _llm(tiny_models, drafts, True).engine
    draft = draft_of(eng)
    for i, p in enumerate(repetitive_prompts(12, seed=7)):
        eng.add_request(f"q{i}", {"prompt_token_ids": p}, GREEDY)
    done: dict[str, Any] = {}
    aborted: list[str] = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs
        eng.check_integrity()
        if not aborted and draft.kv.num_requests >= 2:
            aborted = [rid for rid in draft._base][:2]
            for rid in aborted:
                assert eng.abort_request(rid)
                assert not draft.kv.has_request(rid)
            eng.check_integrity()
    assert aborted and set(done) == {f"q{i}" for i in range(12)} - set(aborted)
    same_outputs(done, {k: reference[k] for k in done})
    assert draft.kv.num_free_blocks == draft.kv.num_blocks


def test_draft_errors_name_the_flag(tiny_models: dict[str, Path], make_model: Any) -> None:
    other = make_model("llama", vocab_size=300)  # another vocabulary
    with pytest.raises(ValueError, match="another tokenizer.*--speculative-config"):
        LLM(model=str(tiny_models["llama"]), num_kv_blocks=64, block_size=4, max_model_len=128,
            speculative_config={"model": str(other)})
    with pytest.raises(ValueError, match="draft_num_kv_blocks"):
        LLM(model=str(tiny_models["llama"]), num_kv_blocks=64,
            speculative_config={"method": "ngram", "draft_num_kv_blocks": 4})


def test_greedy_matches_hf_with_a_draft(tiny_models: dict[str, Path], drafts: dict[str, Path],
                                        hf_llama: Any) -> None:
    import torch

    prompts = repetitive_prompts(12, seed=7)[:3]
    eng = _llm(tiny_models, drafts, True).engine
    got = run(eng, prompts, GREEDY)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            out = hf_llama.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                    max_new_tokens=GREEDY.max_tokens, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
        assert list(got[f"q{i}"][0].token_ids) == out[0, len(p):].tolist(), f"q{i}"
    assert_accepts_and_rejects(eng)


@SLOW
def test_steps_without_proposals_in_between(tiny_models: dict[str, Path],
                                            drafts: dict[str, Path]) -> None:
    """The adaptive rule pauses proposing while more than 4 requests decode: requests that
    proposed, paused and propose again find tokens the draft never saw after its guesses, and
    the draft keeps only the guesses they confirm (proposals checked against the draft's own
    greedy continuation)."""
    llm = LLM(model=str(tiny_models["llama"]), block_size=4, num_kv_blocks=512, max_model_len=128,
              max_num_batched_tokens=24,  # staggered prefills: few decode, then many, then few
              speculative_config=draft_config(drafts["llama"], disable_by_batch_size=4))
    eng = llm.engine
    prompts = repetitive_prompts(12, seed=7)
    params = [GREEDY.clone(max_tokens=6 + 3 * i) for i in range(12)]  # the batch shrinks
    want = run(_llm(tiny_models, drafts, False, max_num_batched_tokens=24).engine, prompts, params)
    seen = record_proposals(eng)
    paused: list[bool] = []
    same_outputs(run(eng, prompts, params, after_step=lambda e: paused.append(
        e.stats.spec.num_drafts == 0 and len(e.scheduler.running) > 4)), want)
    assert any(paused)
    assert_accepts_and_rejects(eng)
    assert_draft_greedy(drafts["llama"], seen)


def test_draft_keeps_only_confirmed_guesses(tiny_models: dict[str, Path],
                                            drafts: dict[str, Path]) -> None:
    """The proposer alone, on requests whose tokens move as a scheduler could move them: all
    guesses confirmed, some, none, several tokens the draft never saw (a paused request), a
    prompt sharing cached blocks. Every proposal is the draft's greedy continuation."""
    from pagedllm.request import Request

    eng = _llm(tiny_models, drafts, True).engine
    draft = draft_of(eng)
    seen = record_proposals(eng)
    prompts = repetitive_prompts(4, seed=11)
    reqs = [Request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    for step in range(6):
        if step == 1:  # its prompt's head hits the blocks of r0's prompt
            reqs.append(Request("r4", prompts[0] + [9, 9, 9, 9, 9], GREEDY))
        outs = draft.propose(reqs, [3, 3, 2, 3, 3][: len(reqs)])
        draft.check_integrity()
        for j, (r, p) in enumerate(zip(reqs, outs)):
            assert len(p) == (2 if j == 2 else 3)
            kept = {0: p, 1: p[:1], 2: [], 3: [7, 8, 9, 10, 11][: step + 1]}.get(j, p[:2])
            for t in kept + [5 + step]:  # the target's own token after the kept guesses
                r.append_token(t)
    assert draft.kv.stats.hits >= len(prompts[0]) // 4 * 4
    draft.release(r.request_id for r in reqs)
    draft.check_integrity()
    assert draft.kv.num_free_blocks == draft.kv.num_blocks
    assert_draft_greedy(drafts["llama"], seen)
