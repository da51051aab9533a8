"""The allocation event trace: recorded through LLM.generate, replayed exactly on a fresh
manager, tampering detected; and a manager-level trace covering grow / compact / shrink."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.kv.manager import KVCacheManager
from pagedllm.kv.trace import KVTracer, TraceMismatch, attach, load, main, replay


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Two shared 12-token system prompts (3 blocks of 4) + distinct tails: prefix hits."""
    rng = random.Random(seed)
    systems = [[rng.randrange(4, 512) for _ in range(12)] for _ in range(2)]
    return [systems[i % 2] + [rng.randrange(4, 512) for _ in range(rng.randrange(3, 30))]
            for i in range(n)]


@pytest.mark.parametrize("mode", [pytest.param("recompute", marks=pytest.mark.slow), "swap"])
def test_trace_of_generate_replays_exactly(tiny_models: dict[str, Path], tmp_path: Path,
                                           mode: str) -> None:
    path = tmp_path / "kv.jsonl"
    llm = LLM(model=str(tiny_models["llama"]), block_size=4, num_kv_blocks=40, max_model_len=128,
              max_num_batched_tokens=48, reserved_fraction=0.0, kv_trace_path=str(path),
              preemption_mode=mode, swap_space=0.002 if mode == "swap" else 0,
              compact_every_n_steps=5)
    prompts = _prompts(12)
    params = [SamplingParams(n=2 if i % 3 == 0 else 1, temperature=1.0, seed=i, max_tokens=24,
                             ignore_eos=True) for i in range(len(prompts))]
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.num_preemptions > 0
    assert llm.get_prefix_cache_stats()["hits"] > 0

    events = load(path)
    ops = Counter(e["op"] for e in events)
    assert events[0]["op"] == "init" and ops["init"] == 1
    for op in ("allocate", "prefix_hit", "cache", "free", "fork", "cow_copy", "take_copies",
               "compact"):
        assert ops[op] > 0, f"no {op} event in {dict(ops)}"
    if mode == "swap":
        assert ops["swap_out"] > 0 and ops["swap_in"] > 0
    steps = [e["step"] for e in events]
    assert steps == sorted(steps) and steps[-1] > 0
    kv = replay(path)
    assert kv.num_free_blocks == kv.num_blocks == llm.engine.kv.num_blocks  # all returned
    assert kv.pool.free_queue.ids() == llm.engine.kv.pool.free_queue.ids()
    assert set(kv.pool.cached) == set(llm.engine.kv.pool.cached)


def _tamper(path: Path, out: Path, edit) -> None:  # type: ignore[no-untyped-def]
    events = load(path)
    edit(events)
    out.write_text("".join(json.dumps(e) + "\n" for e in events))


def test_tampered_trace_is_detected(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "kv.jsonl"
    llm = LLM(model=str(tiny_models["llama"]), block_size=4, num_kv_blocks=40, max_model_len=128,
              max_num_batched_tokens=48, kv_trace_path=str(path))
    llm.generate([{"prompt_token_ids": p} for p in _prompts(6, seed=1)],
                 SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    replay(path)

    def other_block(events: list[dict]) -> None:
        e = next(e for e in events if e["op"] == "allocate" and e["new"])
        e["new"][0] = (e["new"][0] + 1) % 40

    def drop_free(events: list[dict]) -> None:
        events.remove(next(e for e in events if e["op"] == "free"))

    def wrong_hash(events: list[dict]) -> None:
        e = next(e for e in events if e["op"] == "cache")
        e["hashes"][0] = "0" * 32

    def wrong_hit(events: list[dict]) -> None:
        e = next(e for e in events if e["op"] == "prefix_hit")
        e["hashes"][-1] = "f" * 32

    for edit in (other_block, drop_free, wrong_hash, wrong_hit):
        bad = tmp_path / f"{edit.__name__}.jsonl"
        _tamper(path, bad, edit)
        with pytest.raises(TraceMismatch):
            replay(bad)
        assert main([str(bad)]) == 1
    assert main([str(path)]) == 0


def test_manager_trace_grow_compact_shrink_in_memory() -> None:
    kv = KVCacheManager(8, 4)
    tracer = KVTracer()
    attach(kv, tracer)
    assert kv.allocate_slots("a", 8)
    assert kv.allocate_slots("b", 12)
    kv.cache_blocks("a", list(range(8)), 8)
    kv.free("a")  # blocks 0, 1 cached-free
    kv.grow(4)
    assert kv.allocate_slots("c", 24)  # fresh blocks first, then evicts a cached one
    kv.free("c")
    kv.compact()
    assert kv.shrink(4)
    kv.free("b")
    ops = [e["op"] for e in tracer.events]
    assert ops.count("evict") >= 1 and "grow" in ops and "compact" in ops and "shrink" in ops
    assert tracer.events[ops.index("allocate", 3)]["new"][:4] == [8, 9, 10, 11]
    out = replay(tracer.events)
    assert out.num_blocks == 4 and out.num_free_blocks == 4
    with pytest.raises(TraceMismatch, match="init"):
        replay(tracer.events[1:])


def test_tracing_is_off_by_default(tiny_models: dict[str, Path]) -> None:
    llm = LLM(model=str(tiny_models["llama"]), block_size=4, num_kv_blocks=40, max_model_len=128)
    assert not llm.engine.kv.events.active and not llm.engine.kv.events.ops  # builds no event
