"""KV memory management end to end through LLM / LLMEngine on a tiny random Llama: priorities,
copy-on-write sharing (n > 1, beam search), warm-up, swap preemption, compaction, elastic pool.

Every test checks ``check_integrity()`` after each step and that every block returns at the end.
"""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from engine_checks import (
    assert_beams_match_hf,
    assert_same_completion,
    assert_same_outputs,
    audit_kv_moves,
    step_until_idle,
)

from pagedllm import LLM, SamplingParams
from pagedllm.engine import LLMEngine
from pagedllm.sched.preemption import PreemptionCost, choose_preemption

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
# Each memory feature against the plain engine: same tokens, chosen-token logprobs within LP_TOL.
# Measured max |Δ| over these 12 prompts x 24 tokens: 5.7e-6 (swap), 5.2e-6 (recompute,
# compaction), 4.5e-6 (priorities), 3.3e-6 (elastic): batching changes fp32 summation order only.
LP_TOL = 1e-5
SHORT = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)  # load, not compared


def _prompts(n: int, seed: int = 0, lo: int = 5, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 512) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _llm(tiny_models: dict[str, Path], **kw: object) -> LLM:
    args: dict[str, object] = dict(block_size=4, num_kv_blocks=256, max_model_len=128)
    args.update(kw)
    return LLM(model=str(tiny_models["llama"]), **args)


def _run(engine: LLMEngine, prompts: list[list[int]], after_step: Any = None,
         max_steps: int = 2000) -> dict[str, list]:
    """Add ``prompts`` as q0, q1, ... (GREEDY) and step until idle, checking integrity and calling
    ``after_step(step_number)`` after every step; request id -> finished outputs."""
    return step_until_idle(engine, prompts, GREEDY, after_step, max_steps)


def _all_back(engine: LLMEngine) -> None:
    engine.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.fixture(scope="module")
def reference(tiny_models: dict[str, Path]) -> dict[tuple[int, ...], Any]:
    """Greedy outputs (with logprobs) of a roomy pool and no memory features: prompt -> output."""
    llm = _llm(tiny_models, enable_prefix_caching=False)
    prompts = _prompts(12)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert len(outs) == len(prompts)
    return {tuple(p): o.outputs[0] for p, o in zip(prompts, outs)}


def _check_all(done: dict[str, list], prompts: list[list[int]], reference: dict) -> None:
    """Every request q{i} finished with the reference's tokens and logprobs."""
    assert len(done) == len(prompts)
    for i, p in enumerate(prompts):
        assert_same_completion(done[f"q{i}"][0], reference[tuple(p)], LP_TOL, f"prompt {i}")


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
    _check_all(done, prompts, reference)
    _all_back(eng)


def test_generate_with_priorities_and_reserve(tiny_models: dict[str, Path], reference: dict) -> None:
    prompts = _prompts(12)
    llm = _llm(tiny_models, max_num_seqs=4, num_kv_blocks=48, reserved_fraction=0.25,
               max_num_batched_tokens=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                        priority=[i % 3 for i in range(12)])
    assert llm.engine.num_preemptions > 0  # the small pool made the reserve matter
    assert_same_outputs([o.outputs[0] for o in outs], [reference[tuple(p)] for p in prompts],
                        LP_TOL, "priorities")
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
    assert len(shared["g"]) == 4
    assert [o.token_ids for o in shared["g"]] == [sep[f"a{i}"][0].token_ids for i in range(4)]
    # Each sample computes 101 + 7 = 108 positions (the 8th token is sampled, never written).
    # Alone: 4 x ceil(108 / 4) = 108 blocks. Shared: the 25 full prompt blocks once, then per
    # sample its copy of the partial block 25 (token 101) and block 26: 25 + 4 x 2 = 33 (README).
    assert (shared_peak, alone_peak) == (33, 108)


def test_greedy_n_samples_match_greedy_and_abort_leaks_nothing(
        tiny_models: dict[str, Path], reference: dict) -> None:
    prompts = _prompts(4, seed=0)
    llm = _llm(tiny_models, num_kv_blocks=40, max_num_batched_tokens=32)
    sp = GREEDY.clone(n=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert len(outs) == len(prompts)
    for p, o in zip(prompts, outs):
        assert_same_outputs(o.outputs, [reference[tuple(p)]] * 3, LP_TOL, "n=3 greedy")
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
def test_beam_search_matches_hf(tiny_models: dict[str, Path], hf_llama: Any, block_size: int) -> None:
    prompts = _prompts(3, seed=11, lo=6, hi=30)
    width, steps = 3, 6
    llm = _llm(tiny_models, block_size=block_size, num_kv_blocks=128)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], beam_width=width,
                           max_tokens=steps)
    _all_back(llm.engine)
    assert_beams_match_hf(outs, hf_llama, prompts, width, steps)


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
    llm.generate([{"prompt_token_ids": p} for p in others], SHORT, use_tqdm=False)
    before = eng.kv.stats.hits
    users = [system + [7, 8, 9, i] for i in range(3)]
    llm.generate([{"prompt_token_ids": u} for u in users], SHORT, use_tqdm=False)
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
def test_choose_preemption_follows_the_cost_model_in_auto_mode() -> None:
    # recomputing 1000 tokens at 1e12 flops / token vs moving 10 blocks of 1 MiB, per mode
    cheap_swap = PreemptionCost(flops_per_token=1e12, bytes_per_block=2**20, flops_per_s=1e12,
                                bytes_per_s=1e9)  # recompute 1000 s, swap 0.021 s
    cheap_recompute = PreemptionCost(flops_per_token=1.0, bytes_per_block=2**20, flops_per_s=1e12,
                                     bytes_per_s=1e9)  # recompute 1 ns, swap 0.021 s
    assert choose_preemption("auto", cheap_swap, 1000, 10, 64)[0] == "swap"
    how, why = choose_preemption("auto", cheap_recompute, 1000, 10, 64)
    assert how == "recompute" and why.startswith("auto: recompute 1000 tokens")
    # the explicit modes ignore the costs; a full host tier always means recompute
    assert choose_preemption("swap", cheap_recompute, 1000, 10, 64)[0] == "swap"
    assert choose_preemption("recompute", cheap_swap, 1000, 10, 64)[0] == "recompute"
    for mode in ("swap", "auto"):
        how, why = choose_preemption(mode, cheap_swap, 1000, 10, 9)
        assert how == "recompute" and "host tier has 9 free blocks, victim holds 10" in why


def _tight(tiny_models: dict[str, Path], mode: str) -> LLM:
    # 40 blocks of 4 = 160 tokens for 12 requests of up to 83 tokens: preemption is certain
    return _llm(tiny_models, num_kv_blocks=40, max_num_batched_tokens=48, swap_space=0.002,
                preemption_mode=mode, reserved_fraction=0.0)


# (mode, cost model override, the only kind of preemption expected)
PREEMPTION_CASES = {
    "swap": ("swap", None, "swap"),
    "recompute": ("recompute", None, "recompute"),
    # the engine's own estimate for this model: swap_s(b) < recompute_s(4 (b - 1) + 1), below
    "auto": ("auto", None, "swap"),
    "auto-slow-host": ("auto", PreemptionCost(bytes_per_block=4096.0, bytes_per_s=1.0), "recompute"),
}


@pytest.mark.parametrize("case", list(PREEMPTION_CASES))
def test_preemption_modes_keep_greedy_outputs(tiny_models: dict[str, Path], reference: dict,
                                              case: str) -> None:
    mode, cost, kind = PREEMPTION_CASES[case]
    prompts = _prompts(12)
    llm = _tight(tiny_models, mode)
    eng = llm.engine
    assert eng.kv.num_host_blocks == int(0.002 * 2**30) // 4096
    moves = audit_kv_moves(llm)
    if cost is not None:
        eng.scheduler.cost_model = cost
    elif mode == "auto":  # a victim of b blocks has at least 4 (b - 1) + 1 computed tokens
        c = eng.scheduler.cost_model
        assert all(c.swap_s(b) < c.recompute_s(4 * (b - 1) + 1) for b in range(1, 33))
    swapped: list[int] = []
    done = _run(eng, prompts, lambda step: swapped.append(eng.scheduler.num_swapped))
    kinds = eng.scheduler.preemptions_by_kind
    other = "recompute" if kind == "swap" else "swap"
    assert kinds[kind] > 0 and kinds[other] == 0, kinds
    assert (max(swapped) > 0) == (kind == "swap")
    stats = llm.kv_stats()
    assert stats["swapped_out_blocks"] == stats["swapped_in_blocks"]
    assert (stats["swapped_out_blocks"] > 0) == (kind == "swap")
    assert moves["swapped_in"] == stats["swapped_in_blocks"]  # each one checked bit-exact
    _check_all(done, prompts, reference)
    _all_back(eng)
    assert eng.kv.num_free_host_blocks == eng.kv.num_host_blocks


@pytest.mark.parametrize("first", ["requests", "beams"])
def test_beam_search_beside_swap_preemption_finishes_and_matches_hf(
        tiny_models: dict[str, Path], hf_llama: Any, reference: dict, first: str) -> None:
    """Beam searches and greedy requests in a pool too small for both, preemption_mode=swap.
    Beam search runs above the core (``engine/beam.py``): its rounds are ordinary 1-token
    requests, swapped like any other. Requests first: the beams' round requests are the youngest,
    so the victims, and come back from the host tier (when beams lived in the core, one swapped
    out after scoring was never scored again, so beams were never swapped). Beams first: a round
    forked on held blocks keeps its search's place in line (``sched/holds.py``), so requests that
    came after the search cannot starve it. A step cap turns a hang into a failure."""
    llm = _llm(tiny_models, num_kv_blocks=32, max_num_batched_tokens=48, swap_space=0.002,
               preemption_mode="swap", reserved_fraction=0.0)
    eng = llm.engine
    beam_prompts, prompts = _prompts(3, seed=11, lo=6, hi=30), _prompts(12)[:4]
    width, steps = 3, 6
    if first == "beams":
        for i, p in enumerate(beam_prompts):
            eng.add_beam_search(f"b{i}", {"prompt_token_ids": p}, width, steps)
    for i, p in enumerate(prompts):
        eng.add_request(f"q{i}", {"prompt_token_ids": p}, GREEDY)
    if first == "requests":
        for i, p in enumerate(beam_prompts):
            eng.add_beam_search(f"b{i}", {"prompt_token_ids": p}, width, steps)
    done: dict[str, Any] = {}
    swapped_beams: set[str] = set()
    for _ in range(300):
        if not eng.has_unfinished_requests():
            break
        done.update((o.request_id, o) for o in eng.step() if o.finished)
        eng.check_integrity()
        swapped_beams.update(r.request_id for r in eng.scheduler.swapped if eng.beams.owns(r.request_id))
    assert not eng.has_unfinished_requests(), f"hung: {eng.request_ids()} unfinished"
    kinds = eng.scheduler.preemptions_by_kind
    # every preemption a swap; beam rounds among the victims only when they came last
    assert kinds["swap"] > 0 and kinds["recompute"] == 0, kinds
    assert bool(swapped_beams) == (first == "requests"), swapped_beams
    searches = [SimpleNamespace(sequences=done[f"b{i}"].outputs) for i in range(3)]
    assert_beams_match_hf(searches, hf_llama, beam_prompts, width, steps)
    _check_all({k: v.outputs for k, v in done.items() if k.startswith("q")}, prompts, reference)
    _all_back(eng)
    assert eng.kv.num_free_host_blocks == eng.kv.num_host_blocks


def test_abort_swapped_and_sharing_requests_leaks_nothing(tiny_models: dict[str, Path]) -> None:
    llm = _tight(tiny_models, "swap")
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
def test_on_demand_compaction_keeps_greedy_outputs(tiny_models: dict[str, Path],
                                                   reference: dict) -> None:
    prompts = _prompts(12)
    llm = _llm(tiny_models, num_kv_blocks=80, max_num_batched_tokens=48)  # no trigger configured
    moved: list[int] = []

    def defragment(step: int) -> None:
        moved.append(llm.defragment())
        assert llm.engine.kv.fragmentation() == 0
        assert llm.engine.memory.num_compactions == step  # one per call, nothing else

    done = _run(llm.engine, prompts, defragment)
    assert sum(moved) > 0
    _check_all(done, prompts, reference)
    _all_back(llm.engine)


def test_every_n_steps_trigger_fires_on_its_steps_only(tiny_models: dict[str, Path],
                                                       reference: dict) -> None:
    prompts = _prompts(12)
    llm = _llm(tiny_models, num_kv_blocks=80, max_num_batched_tokens=48, compact_every_n_steps=3)
    eng = llm.engine
    fragmented_between = 0

    def check(step: int) -> None:
        nonlocal fragmented_between
        assert eng.memory.num_compactions == step // 3, f"step {step}"
        if step % 3 == 0:
            assert eng.kv.fragmentation() == 0  # it ran at the end of this step
        else:
            fragmented_between = max(fragmented_between, eng.kv.fragmentation())

    done = _run(llm.engine, prompts, check)
    assert fragmented_between > 0  # there was something to move when it fired
    _check_all(done, prompts, reference)
    _all_back(eng)


@pytest.mark.parametrize("threshold", [0.0, 0.97, 1.01])  # never / sometimes / always below
def test_low_utilization_trigger_fires_after_its_window_only(
        tiny_models: dict[str, Path], reference: dict, threshold: float) -> None:
    """The trigger fires once KV utilization (live tokens / their block tables' slots) stayed below the
    threshold for ``compact_window_steps`` consecutive steps, then counts afresh; a shadow of
    that rule, fed the utilization after each step, predicts every firing."""
    prompts = _prompts(12)
    window = 2
    llm = _llm(tiny_models, num_kv_blocks=80, max_num_batched_tokens=48,
               compact_below_utilization=threshold, compact_window_steps=window)
    eng = llm.engine
    low = expected = 0

    def check(step: int) -> None:
        nonlocal low, expected
        held = [r for r in eng.scheduler.requests.values() if eng.kv.has_request(r.request_id)]
        live = sum(r.num_computed_tokens for r in held)
        reserved = sum(len(eng.kv.held_blocks(r.request_id)) for r in held) * 4
        util = live / reserved if reserved else 0.0
        low = low + 1 if util < threshold else 0
        if low == window:
            expected, low = expected + 1, 0
        assert eng.memory.num_compactions == expected, f"step {step}, utilization {util:.3f}"

    done = _run(llm.engine, prompts, check)
    steps = eng.memory.steps
    if threshold == 0.0:
        assert expected == 0
    elif threshold > 1:
        assert expected == steps // window
    else:
        assert 0 < expected < steps // window  # fired on its condition, not on every window
    _check_all(done, prompts, reference)
    _all_back(eng)


def test_elastic_pool_grows_and_shrinks(tiny_models: dict[str, Path], reference: dict) -> None:
    prompts = _prompts(12)
    llm = _llm(tiny_models, num_kv_blocks=200, initial_num_kv_blocks=16, grow_chunk=16,
               max_num_batched_tokens=64)
    eng = llm.engine
    assert eng.kv.num_blocks == 16 and eng.runner.kv_cache.num_blocks == 16
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert_same_outputs([o.outputs[0] for o in outs], [reference[tuple(p)] for p in prompts],
                        LP_TOL, "elastic")
    assert eng.memory.num_grows > 0 and eng.memory.num_shrinks > 0
    assert eng.kv.num_blocks == 16 == eng.runner.kv_cache.num_blocks  # idle: back to the start
    _all_back(eng)
