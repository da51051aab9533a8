"""KV memory management end to end through LLM / LLMEngine on a tiny random Llama: priorities,
copy-on-write sharing (n > 1, beam search), warm-up, swap preemption, compaction, elastic pool.

Every test checks ``check_integrity()`` after each step and that every block returns at the end.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine import LLMEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _prompts(n: int, seed: int = 0, lo: int = 5, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 512) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _llm(tiny_models: dict[str, Path], **kw: object) -> LLM:
    args: dict[str, object] = dict(block_size=4, num_kv_blocks=256, max_model_len=128)
    args.update(kw)
    return LLM(model=str(tiny_models["llama"]), **args)


def _run(engine: LLMEngine, max_steps: int = 2000) -> dict[str, list]:
    """Step until idle, checking integrity after every step; request id -> finished outputs."""
    done: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs
        engine.check_integrity()
    assert not engine.has_unfinished_requests()
    return done


def _all_back(engine: LLMEngine) -> None:
    engine.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.fixture(scope="module")
def reference(tiny_models: dict[str, Path]) -> dict[tuple[int, ...], list[int]]:
    """Greedy outputs with a roomy pool and no memory features: prompt -> token ids."""
    llm = _llm(tiny_models, enable_prefix_caching=False)
    prompts = _prompts(12)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, outs)}


# -- 1. priorities --------------------------------------------------------------------------------
def test_priorities_keep_greedy_outputs_and_serve_urgent_first(
        tiny_models: dict[str, Path], reference: dict) -> None:
    prompts = _prompts(12)
    llm = _llm(tiny_models, max_num_seqs=3, num_kv_blocks=64)
    eng = llm.engine
    prios = [5] * 8 + [0] * 4  # the urgent ones arrive last
    for i, p in enumerate(prompts[:8]):
        eng.add_request(f"q{i}", {"prompt_token_ids": p}, GREEDY, priority=prios[i])
    first_step: dict[str, int] = {}
    done: dict[str, list] = {}
    step = 0
    while eng.has_unfinished_requests():
        if step == 3:  # urgent requests arrive while the seats are taken
            for i in range(8, 12):
                eng.add_request(f"q{i}", {"prompt_token_ids": prompts[i]}, GREEDY, priority=0)
        for out in eng.step():
            first_step.setdefault(out.request_id, step)
            if out.finished:
                done[out.request_id] = out.outputs
        eng.check_integrity()
        step += 1
    assert eng.scheduler.preemptions_by_kind["priority"] > 0
    urgent = [first_step[f"q{i}"] for i in range(8, 12)]
    waiting_low = [first_step[f"q{i}"] for i in range(3, 8)]  # not yet started at step 3
    assert max(urgent) < min(waiting_low)
    for i, p in enumerate(prompts):
        assert done[f"q{i}"][0].token_ids == reference[tuple(p)]
    _all_back(eng)


def test_generate_with_priorities_and_reserve(tiny_models: dict[str, Path], reference: dict) -> None:
    prompts = _prompts(12)
    llm = _llm(tiny_models, max_num_seqs=4, num_kv_blocks=48, reserved_fraction=0.25,
               max_num_batched_tokens=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                        priority=[i % 3 for i in range(12)])
    assert [o.outputs[0].token_ids for o in outs] == [reference[tuple(p)] for p in prompts]
    _all_back(llm.engine)


# -- 2. copy-on-write sharing -------------------------------------------------------------------
def _peak_blocks(engine: LLMEngine, reqs: list[tuple[str, list[int], SamplingParams]]) -> tuple[int, dict]:
    for rid, p, sp in reqs:
        engine.add_request(rid, {"prompt_token_ids": p}, sp)
    peak, done = 0, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs
        engine.check_integrity()
        peak = max(peak, engine.kv.num_blocks - engine.kv.num_free_blocks)
    _all_back(engine)
    return peak, done


def test_n_samples_share_prompt_blocks(tiny_models: dict[str, Path]) -> None:
    prompt = _prompts(1, seed=5, lo=101, hi=102)[0]  # 101 tokens: 25 full blocks + 1 token
    sp = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    shared_peak, shared = _peak_blocks(_llm(tiny_models, enable_prefix_caching=False).engine,
                                       [("g", prompt, sp)])
    # the same samples as 4 independent requests (seed + i, as the engine gives child i)
    alone = [(f"a{i}", prompt, sp.clone(n=1, seed=7 + i)) for i in range(4)]
    alone_peak, sep = _peak_blocks(_llm(tiny_models, enable_prefix_caching=False).engine, alone)
    assert [o.token_ids for o in shared["g"]] == [sep[f"a{i}"][0].token_ids for i in range(4)]
    # shared: 26 prompt blocks once + 3 copies of the partial block + 2 new blocks each
    assert shared_peak < alone_peak
    print(f"n=4, 101-token prompt, block 4: peak blocks {shared_peak} shared vs {alone_peak}")


def test_greedy_n_samples_match_greedy_and_abort_leaks_nothing(
        tiny_models: dict[str, Path], reference: dict) -> None:
    prompts = _prompts(4, seed=0)
    llm = _llm(tiny_models, num_kv_blocks=40, max_num_batched_tokens=32)
    sp = SamplingParams(n=3, temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert [c.token_ids for c in o.outputs] == [reference[tuple(p)]] * 3
    _all_back(llm.engine)
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"ab{i}", {"prompt_token_ids": p}, sp)
    for _ in range(4):
        eng.step()
        eng.check_integrity()
    for i in range(len(prompts)):
        eng.abort_request(f"ab{i}")
    _all_back(eng)


@pytest.mark.parametrize("block_size", [4, 16])
def test_beam_search_matches_hf(tiny_models: dict[str, Path], block_size: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    path = tiny_models["llama"]
    prompts = _prompts(3, seed=11, lo=6, hi=30)
    width, steps = 3, 6
    llm = _llm(tiny_models, block_size=block_size, num_kv_blocks=128)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], beam_width=width,
                           max_tokens=steps)
    _all_back(llm.engine)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 num_beams=width, num_return_sequences=width, do_sample=False,
                                 length_penalty=0.0, max_new_tokens=steps, eos_token_id=None,
                                 pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        hf_seqs = [s[len(p):].tolist() for s in ref.sequences]
        assert [s.token_ids for s in o.sequences] == hf_seqs
        for s, score in zip(o.sequences, ref.sequences_scores.tolist()):
            assert abs(s.cumulative_logprob - score) < 1e-3


# -- 3. warm-up and prefix-cache stats ----------------------------------------------------------
def test_preheat_pins_system_prompt_and_counts_hits(tiny_models: dict[str, Path],
                                                    tmp_path: Path) -> None:
    system = _prompts(1, seed=9, lo=40, hi=41)[0]  # 40 tokens = 10 full blocks of 4
    f = tmp_path / "preheat.txt"
    f.write_text(str(system) + "\n")
    llm = _llm(tiny_models, num_kv_blocks=40, preheat_prompts=str(f))
    eng = llm.engine
    assert eng.kv.num_pinned_blocks == 9  # the 40th token is never a hit: 36 tokens = 9 blocks
    assert llm.get_prefix_cache_stats() == {"queries": 0, "hits": 0, "hit_rate": 0.0}
    # unrelated traffic that needs the whole pool would evict anything unpinned
    others = _prompts(6, seed=1, lo=50, hi=60)
    llm.generate([{"prompt_token_ids": p} for p in others], GREEDY, use_tqdm=False)
    before = eng.kv.stats.hits
    users = [system + [7, 8, 9, i] for i in range(3)]
    llm.generate([{"prompt_token_ids": u} for u in users], GREEDY, use_tqdm=False)
    assert eng.kv.stats.hits - before >= 3 * 36  # every user request hit the pinned prefix
    stats = llm.kv_stats()
    assert stats["pinned_blocks"] == 9 and stats["used_blocks"] == 9
    assert 0 < stats["prefix_cache_hit_rate"] <= 1
    eng.kv.unpin_all()
    _all_back(eng)


def test_prefix_stats_count_each_admission_once() -> None:
    from pagedllm.config import SchedulerConfig
    from pagedllm.kv.manager import KVCacheManager
    from pagedllm.request import Request
    from pagedllm.sched import Scheduler

    kv = KVCacheManager(6, 4, enable_prefix_caching=True)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=24,
                                  reserved_fraction=0.0), kv)
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    s.add_request(Request("a", list(range(16)), sp, max_model_len=24))
    s.add_request(Request("b", list(range(100, 116)), sp, max_model_len=24))  # waits for blocks
    steps = 0
    while s.has_unfinished_requests():
        out = s.schedule()
        s.update(out, {x.request.request_id: 1 for x in out.scheduled if x.samples})
        steps += 1
    assert steps > 5 and kv.stats.queries == 32  # b retried every step, counted once


# -- 4. host tier: preemption by swap -----------------------------------------------------------
@pytest.mark.parametrize("mode", ["swap", "auto", "recompute"])
def test_swap_preemption_keeps_greedy_outputs(tiny_models: dict[str, Path], reference: dict,
                                              mode: str) -> None:
    prompts = _prompts(12)
    # 40 blocks of 4 = 160 tokens for 12 requests of up to 68 tokens: preemption is certain
    llm = _llm(tiny_models, num_kv_blocks=40, max_num_batched_tokens=48, swap_space=0.002,
               preemption_mode=mode, reserved_fraction=0.0)
    eng = llm.engine
    assert eng.kv.num_host_blocks == int(0.002 * 2**30) // 4096
    for i, p in enumerate(prompts):
        eng.add_request(f"q{i}", {"prompt_token_ids": p}, GREEDY)
    seen_swapped = 0
    done: dict[str, list] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs
        eng.check_integrity()
        seen_swapped = max(seen_swapped, eng.scheduler.num_swapped)
    kinds = eng.scheduler.preemptions_by_kind
    if mode == "swap":
        assert kinds["swap"] > 0 and kinds["recompute"] == 0 and seen_swapped > 0
    if mode == "recompute":
        assert kinds["swap"] == 0 and kinds["recompute"] > 0
    if mode == "auto":  # a tiny model recomputes faster than it moves KV: cost model says so
        assert kinds["swap"] + kinds["recompute"] > 0
    stats = llm.kv_stats()
    assert stats["swapped_out_blocks"] == stats["swapped_in_blocks"]
    for i, p in enumerate(prompts):
        assert done[f"q{i}"][0].token_ids == reference[tuple(p)], f"prompt {i} diverged"
    _all_back(eng)
    assert eng.kv.num_free_host_blocks == eng.kv.num_host_blocks


def test_abort_swapped_and_sharing_requests_leaks_nothing(tiny_models: dict[str, Path]) -> None:
    llm = _llm(tiny_models, num_kv_blocks=40, max_num_batched_tokens=48, swap_space=0.002,
               preemption_mode="swap", reserved_fraction=0.0)
    eng = llm.engine
    prompts = _prompts(8, seed=4)
    for i, p in enumerate(prompts):
        eng.add_request(f"q{i}", {"prompt_token_ids": p},
                        SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=30, ignore_eos=True))
    for _ in range(200):
        eng.step()
        eng.check_integrity()
        if eng.scheduler.num_swapped:
            break
    assert eng.scheduler.num_swapped > 0
    for i in range(len(prompts)):
        eng.abort_request(f"q{i}")
    _all_back(eng)
    assert eng.kv.num_free_host_blocks == eng.kv.num_host_blocks


# -- 5. compaction and the elastic pool -----------------------------------------------------------
def test_forced_compactions_keep_greedy_outputs(tiny_models: dict[str, Path], reference: dict) -> None:
    prompts = _prompts(12)
    llm = _llm(tiny_models, num_kv_blocks=80, max_num_batched_tokens=48, compact_every_n_steps=2,
               compact_below_utilization=0.9, compact_window_steps=3)
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"q{i}", {"prompt_token_ids": p}, GREEDY)
    done: dict[str, list] = {}
    moved = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs
        moved += llm.defragment()  # and on demand, every step
        eng.check_integrity()
        assert eng.kv.fragmentation() == 0
    assert eng.memory.num_compactions > 0 and moved > 0
    for i, p in enumerate(prompts):
        assert done[f"q{i}"][0].token_ids == reference[tuple(p)], f"prompt {i} diverged"
    _all_back(eng)


def test_elastic_pool_grows_and_shrinks(tiny_models: dict[str, Path], reference: dict) -> None:
    prompts = _prompts(12)
    llm = _llm(tiny_models, num_kv_blocks=200, initial_num_kv_blocks=16, grow_chunk=16,
               max_num_batched_tokens=64)
    eng = llm.engine
    assert eng.kv.num_blocks == 16 and eng.runner.kv_cache.num_blocks == 16
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [reference[tuple(p)] for p in prompts]
    assert eng.memory.num_grows > 0 and eng.memory.num_shrinks > 0
    assert eng.kv.num_blocks == 16 == eng.runner.kv_cache.num_blocks  # idle: back to the start
    _all_back(eng)
