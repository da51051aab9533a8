"""Unified paging: LoRA adapters' weights in blocks of the KV pool (kv/adapters.py,
lora/pages.py), paged in and out as the scheduler needs room, under one count of blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.config import SchedulerConfig
from pagedllm.kv.manager import KVCacheManager
from pagedllm.request import Request
from pagedllm.sched import Scheduler

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


# -- the scheduler's side: pure Python ---------------------------------------------------------
def _scheduler(num_blocks: int, max_loras: int = 2, max_num_seqs: int = 4) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
                                     max_model_len=64, max_loras=max_loras),
                     KVCacheManager(num_blocks, 4))


def _lora(i: int) -> LoRARequest:
    return LoRARequest(f"a{i}", i, f"/a{i}")


def _drive(sched: Scheduler, max_steps: int = 500) -> list:
    """Step until done, checking the pool each step; the steps' outputs."""
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outs
        out = sched.schedule()
        pages = sched.kv.adapters
        for s in out.scheduled:  # a request runs only with its adapter resident, where the step says
            lr = s.request.lora_request
            if lr is not None:
                assert out.kv.lora_pages[lr.lora_int_id] == pages.blocks_of(lr.lora_int_id)
        for r in sched.running:  # the adapters of requests holding KV are never paged out
            if r.lora_request is not None:
                assert r.lora_request.lora_int_id in pages.held
        outs.append(out)
        sched.update(out, {s.request.request_id: 9 for s in out.scheduled if s.samples})
        sched.kv.check_integrity()
    raise AssertionError("requests did not finish")


def test_adapters_page_in_on_demand_and_out_least_recently_used_first() -> None:
    """A pool of 16 blocks, adapters of 5: at most 3 resident; a fourth pages out the least
    recently used idle one; every step's page-ins and page-outs travel in its KVUpdate."""
    sched = _scheduler(16, max_loras=1)
    for i in (1, 2, 3, 4):
        sched.kv.adapters.register(i, 5)
    loads, evictions = [], []
    for i in (1, 2, 3, 4, 1):
        r = Request(f"r{i}-{len(loads)}", [5, 6, 7], SamplingParams(max_tokens=1))
        r.lora_request = _lora(i)
        sched.add_request(r)
        for out in _drive(sched):
            loads += [lid for lid, _ in out.kv.lora_loads]
            evictions += out.kv.lora_evictions
    assert loads == [1, 2, 3, 4, 1] and evictions == [1, 2]  # 4 evicts 1 (LRU), 1 evicts 2
    assert sched.kv.adapters.resident == [3, 4, 1]
    assert sched.kv.adapters.num_blocks == 15 and sched.kv.num_free_blocks == 1


def test_kv_cache_takes_idle_adapters_pages_before_preempting() -> None:
    """Idle adapters compete with the KV cache: a long base request takes their pages (they are
    paged out) rather than preempting anyone, and the adapter pages in again when next needed."""
    sched = _scheduler(16, max_loras=2)
    for i in (1, 2):
        sched.kv.adapters.register(i, 6)
    for i in (1, 2):
        r = Request(f"warm{i}", [5, 6, 7], SamplingParams(max_tokens=1))
        r.lora_request = _lora(i)
        sched.add_request(r)
    _drive(sched)
    assert sched.kv.adapters.num_blocks == 12
    sched.add_request(Request("long", list(range(5, 45)), SamplingParams(max_tokens=8)))  # 12 blocks
    outs = _drive(sched)
    assert sum(len(o.kv.lora_evictions) for o in outs) == 2 and sched.num_preemptions == 0
    r = Request("again", [5, 6, 7], SamplingParams(max_tokens=2))
    r.lora_request = _lora(2)
    sched.add_request(r)
    assert [lid for o in _drive(sched) for lid, _ in o.kv.lora_loads] == [2]


def test_an_adapter_that_does_not_fit_now_waits_and_nobody_overtakes() -> None:
    """While running requests' adapters and KV fill the pool, a request whose adapter cannot be
    paged in waits (first come, first served), and runs once the pool has room."""
    sched = _scheduler(12, max_loras=2, max_num_seqs=4)
    for i in (1, 2):
        sched.kv.adapters.register(i, 6)
    a = Request("a", [5, 6, 7, 8], SamplingParams(max_tokens=12))
    a.lora_request = _lora(1)
    b = Request("b", [5, 6, 7], SamplingParams(max_tokens=2))
    b.lora_request = _lora(2)
    base = Request("base", [5, 6], SamplingParams(max_tokens=2))
    for r in (a, b, base):
        sched.add_request(r)
    first = sched.schedule()
    assert [s.request.request_id for s in first.scheduled] == ["a"]  # b waits, base behind it
    sched.update(first, {"a": 9})
    _drive(sched)
    assert sched.kv.adapters.num_loads == 2


def test_a_request_whose_adapter_and_kv_never_fit_is_refused_at_once() -> None:
    sched = _scheduler(10, max_loras=1)
    sched.kv.adapters.register(1, 4)
    r = Request("r", list(range(5, 25)), SamplingParams(max_tokens=6))  # 26 tokens: 7 blocks
    r.lora_request = _lora(1)
    with pytest.raises(ValueError, match="'a1': its weights take 4 KV blocks and this request "
                                         "up to 7 more"):
        sched.add_request(r)
    assert not sched.has_unfinished_requests() and sched.kv.num_free_blocks == 10
    r = Request("ok", list(range(5, 25)), SamplingParams(max_tokens=4))  # 24 tokens: 6 blocks
    r.lora_request = _lora(1)
    sched.add_request(r)
    _drive(sched)


def test_compaction_moves_adapters_pages_with_them() -> None:
    sched = _scheduler(24, max_loras=1)
    sched.kv.adapters.register(1, 3)
    first = Request("first", list(range(5, 25)), SamplingParams(max_tokens=1))  # 5 blocks
    sched.add_request(first)
    sched.schedule()
    r = Request("r", [5, 6, 7], SamplingParams(max_tokens=1))
    r.lora_request = _lora(1)
    sched.add_request(r)
    out = sched.schedule()
    assert out.kv.lora_loads == [(1, [5, 6, 7])]
    assert sched.kv.block_table("r") == [8]
    sched.kv.free("first")  # blocks 0-4 free: compaction moves the adapter's pages and r's block
    assert dict(sched.kv.compact()) == {5: 0, 6: 1, 7: 2, 8: 3}
    assert sched.kv.adapters.blocks_of(1) == [0, 1, 2] and sched.kv.block_table("r") == [3]
    sched.kv.check_integrity()


def test_a_page_in_pending_across_a_compaction_is_written_where_its_blocks_went() -> None:
    """A page-in made between steps (a fork pages its adapter in at add_request), then a
    compaction (``defragment``) before the next step: the step's load names the blocks after
    the move, not the freed ids the weights would otherwise overwrite."""
    kv = KVCacheManager(12, 4)
    kv.adapters.register(1, 3)
    kv.allocate_slots("gap", 8)  # blocks 0-1, freed below: a hole for compaction to fill
    assert kv.adapters.ensure(1, ())
    assert kv.adapters.blocks_of(1) == [2, 3, 4]
    kv.free("gap")
    assert dict(kv.compact()) == {3: 0, 4: 1}  # live blocks fill ids 0-2; block 2 stays
    assert kv.adapters.take_changes() == ([(1, [2, 0, 1])], [])


@settings(max_examples=40, deadline=None)
@given(st.integers(10, 30), st.lists(st.tuples(st.integers(0, 5), st.integers(1, 20),
                                               st.integers(1, 6)), min_size=1, max_size=14),
       st.integers(1, 3))
def test_every_request_finishes_and_the_pool_stays_whole(num_blocks: int, reqs: list, max_loras: int) -> None:
    """Random adapters (0: the base) of 2-4 blocks, prompts and lengths, over a pool that often
    cannot hold them all: every request finishes, each step runs at most ``max_loras`` adapters,
    each with its pages; no block is lost (``check_integrity`` every step)."""
    sched = _scheduler(num_blocks, max_loras=max_loras)
    for i in range(1, 6):
        sched.kv.adapters.register(i, 2 + i % 3)
    for k, (lid, prompt, out_len) in enumerate(reqs):
        r = Request(f"r{k}", [5 + j for j in range(prompt)], SamplingParams(max_tokens=out_len))
        r.lora_request = _lora(lid) if lid else None
        try:
            sched.add_request(r)
        except ValueError as e:  # refused only if adapter and KV could never be in the pool together
            assert lid and 2 + lid % 3 + -(-(prompt + out_len) // 4) > num_blocks, e
    for out in _drive(sched, 2000):
        assert len({s.request.lora_request.lora_int_id for s in out.scheduled
                    if s.request.lora_request}) <= max_loras
    kv = sched.kv
    assert kv.num_free_blocks + kv.adapters.num_blocks == kv.num_blocks


# -- the engine: 32 adapters through a pool that holds 4, against HF + PEFT --------------------
def _many_adapters(base: Path, root: Path, n: int) -> list[Path]:
    """``n`` random rank-8 adapters on every target, from one PEFT model re-drawn per adapter."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets,
                                                  init_lora_weights=False))
    paths = []
    for i in range(n):
        torch.manual_seed(100 + i)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_" in name:
                    p.normal_(0.0, 0.3)
        peft_model.save_pretrained(root / f"a{i}")
        paths.append(root / f"a{i}")
    return paths


def _hf_peft(base: Path, adapters: list[Path], prompts: list[list[int]]) -> list[list[int]]:
    """Prompt i under adapter i, HF + PEFT one at a time (fp32 greedy)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                      adapters[0], adapter_name="a0").eval()
    outs = []
    for i, (path, p) in enumerate(zip(adapters, prompts)):
        if i:
            model.load_adapter(path, adapter_name=f"a{i}")
        model.set_adapter(f"a{i}")
        with torch.no_grad():
            o = model.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
        outs.append(o[0, len(p):].tolist())
    return outs


def test_32_adapters_through_a_pool_that_holds_4(lora_base: Path, tmp_path: Path) -> None:
    paths = _many_adapters(lora_base, tmp_path, 32)
    prompts = [[5 + (7 * i + j) % 500 for j in range(12 + i % 9)] for i in range(32)]
    want = _hf_peft(lora_base, paths, prompts)
    probe = LLM(str(lora_base), enable_lora=True, max_lora_rank=8, num_kv_blocks=64,
                block_size=16, dtype="float32")
    probe.generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False,
                   lora_request=LoRARequest("a0", 1, str(paths[0])))
    pages = probe.engine.kv.adapters.sizes[1]  # measured by the runner from the real adapter
    plan = probe.engine.kv_plan  # the planner's arithmetic for rank 8 on every projection
    assert (plan.lora_blocks_per_adapter, plan.lora_blocks) == (pages, pages)  # max_loras=1
    del probe
    # 2 requests at a time hold at most 4 KV blocks (<= 28 tokens each): 4 adapters fit, 5 never
    llm = LLM(str(lora_base), enable_lora=True, max_lora_rank=8, max_loras=2, max_cpu_loras=3,
              max_num_seqs=2, max_model_len=64, num_kv_blocks=4 * pages + 4, block_size=16,
              dtype="float32")
    loras = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                        lora_request=loras)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    stats = llm.kv_stats()
    assert stats["lora_page_ins"] >= 32 and stats["lora_page_outs"] >= 28
    assert stats["lora_resident_adapters"] <= 4 and stats["lora_blocks"] <= 4 * pages
    llm.engine.kv.check_integrity()
    base = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert sum(list(o.outputs[0].token_ids) != w for o, w in zip(base, want)) >= 24  # deltas show


def test_planner_replay_pages_adapters_as_the_engine_does(lora_base: Path, tmp_path: Path) -> None:
    """``pagedllm plan --lora-adapters``'s replay (no model: the engine's scheduler with the
    plan's page count per adapter) schedules and pages exactly as the real engine does."""
    from pagedllm.args import EngineArgs
    from pagedllm.bench.workload import BenchRequest
    from pagedllm.planner.replay import replay

    paths = _many_adapters(lora_base, tmp_path, 6)
    prompts = [[5 + (11 * i + 3 * j) % 500 for j in range(6 + 5 * (i % 4))] for i in range(12)]
    lens = [4 + 3 * (i % 3) for i in range(12)]
    kw = dict(enable_lora=True, max_lora_rank=8, max_loras=2, max_num_seqs=4, max_model_len=64,
              block_size=16, dtype="float32")
    pages = 5  # rank 8 on every projection of the tiny model (asserted above)
    kw["num_kv_blocks"] = 2 * pages + 4  # two adapters and 4 KV blocks: adapters take turns
    llm = LLM(str(lora_base), **kw)
    loras = [LoRARequest(f"a{i % 6}", 1 + i % 6, str(paths[i % 6])) for i in range(12)]
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens],
                 use_tqdm=False, lora_request=loras)
    engine = llm.engine.core
    reqs = [BenchRequest(p, n, lora_id=1 + i % 6) for i, (p, n) in enumerate(zip(prompts, lens))]
    res = replay(reqs, EngineArgs.from_kwargs({"model": str(lora_base), **kw}).create_engine_config())
    pool = engine.kv.adapters
    assert pool.num_loads > 6 and pool.num_evictions > 0  # adapters were paged out and in again
    assert (res.num_steps, res.num_preemptions, res.lora_page_ins, res.lora_page_outs) == \
        (engine.scheduler.num_steps, engine.scheduler.num_preemptions, pool.num_loads,
         pool.num_evictions)


def test_a_fork_of_a_held_request_pages_its_adapter_in_first() -> None:
    """A ``fork_of`` request starts at once on the held blocks; its adapter, paged out while
    the request was held, is paged in first (else the step would run an adapter with no pages)."""
    sched = _scheduler(20, max_loras=1)
    for i in (1, 2):
        sched.kv.adapters.register(i, 6)
    a = Request("a", list(range(5, 15)), SamplingParams(max_tokens=1, ignore_eos=True))
    a.lora_request, a.keep_kv_s = _lora(1), 30.0
    sched.add_request(a)
    _drive(sched)  # a finishes; its 3 blocks are held, adapter 1 idle
    b = Request("b", list(range(5, 29)), SamplingParams(max_tokens=2, ignore_eos=True))
    b.lora_request = _lora(2)  # 6 pages + 7 KV blocks beside the hold's 3: adapter 1 goes
    sched.add_request(b)
    _drive(sched)
    assert sched.kv.adapters.resident == [2] and "a" in sched.holds
    fork = Request("f", list(range(5, 15)) + [7], SamplingParams(max_tokens=2, ignore_eos=True))
    fork.lora_request, fork.fork_of = _lora(1), "a"
    sched.add_request(fork)
    assert fork in sched.running and fork.num_computed_tokens == 10
    out = _drive(sched)[0]
    assert out.kv.lora_loads and out.kv.lora_loads[0][0] == 1


def test_an_adapter_or_request_the_pool_can_never_hold_is_refused_and_the_engine_serves_on(
        lora_base: Path, tmp_path: Path) -> None:
    """Through the engine: an adapter bigger than the pool, then a request whose adapter and KV
    never fit together; each a ValueError naming the adapter, nothing queued, every block back,
    and the next request runs with HF + PEFT's tokens."""
    (path,) = _many_adapters(lora_base, tmp_path, 1)  # rank 8: 5 blocks of 16 tokens
    small = LLM(str(lora_base), enable_lora=True, max_lora_rank=8, num_kv_blocks=4, block_size=16,
                dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="'big': its weights take 5 KV blocks .* the pool has 4"):
        small.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False,
                       lora_request=LoRARequest("big", 1, str(path)))
    llm = LLM(str(lora_base), enable_lora=True, max_lora_rank=8, num_kv_blocks=8, block_size=16,
              dtype="float32", max_model_len=64)
    lr = LoRARequest("a0", 1, str(path))
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)  # 60 tokens: 4 blocks
    with pytest.raises(ValueError, match="'a0': its weights take 5 KV blocks and this request up to 4"):
        llm.generate([{"prompt_token_ids": list(range(5, 25))}], long, use_tqdm=False, lora_request=lr)
    kv = llm.engine.kv
    assert not llm.engine.core.scheduler.requests
    assert kv.num_free_blocks + kv.adapters.num_blocks == kv.num_blocks
    prompt = [5, 9, 17, 33]
    got = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False, lora_request=lr)
    assert list(got[0].outputs[0].token_ids) == _hf_peft(lora_base, [path], [prompt])[0]
    kv.check_integrity()
