"""Every KV change reaches every tensor-parallel rank through the step.

The mistral fixture has one KV head (MQA): with 2 ranks both hold that same head, computed from
the same all-reduced hidden states, so their KV pools must stay equal through every move (swap,
copy-on-write, compaction, growth, shrink) up to float rounding (the fused qkv matmuls differ in
their q columns: seen ~1e-6). A move applied on rank 0 only would leave rank 1's blocks elsewhere
(differences of order 1).
"""

from __future__ import annotations

from pathlib import Path

from pagedllm import LLM, SamplingParams
from pagedllm.runner.model_runner import ModelRunner


def _same_kv(llm: LLM) -> int:
    """Assert both ranks' KV pools are identical and as big as the manager's; returns blocks."""
    eng = llm.engine
    rank0, rank1 = eng.executor.collective_rpc(ModelRunner.kv_contents)
    assert len(rank0) == len(rank1)
    for a, b in zip(rank0, rank1):
        assert a.shape[2] == eng.kv.num_blocks, "a resize did not reach this rank"
        assert (a - b).abs().max().item() < 1e-5, "rank 1's KV differs from rank 0's"
    return int(rank0[0].shape[2])


def test_compaction_and_resize_reach_the_worker_through_the_step(tiny_models: dict[str, Path]) -> None:
    llm = LLM(model=str(tiny_models["mistral"]), tensor_parallel_size=2, block_size=4,
              num_kv_blocks=28, initial_num_kv_blocks=12, grow_chunk=4, max_model_len=64,
              preemption_mode="swap", swap_space=0.002, compact_every_n_steps=3)
    eng = llm.engine
    try:
        sp = SamplingParams(n=2, temperature=0.0, max_tokens=14, ignore_eos=True)
        for i in range(6):
            eng.add_request(f"r{i}", {"prompt_token_ids": [(7 * i + j) % 90 + 3 for j in range(9 + i)]}, sp)
        seen: set[str] = set()
        sizes = {_same_kv(llm)}
        moved = 0
        while eng.has_unfinished_requests():
            if eng.memory.num_compactions > 0 and not moved:
                moved = llm.defragment()  # on demand, between steps: a KV-only step
                assert _same_kv(llm)
            before = (eng.memory.num_compactions, eng.memory.num_grows, eng.memory.num_shrinks,
                      eng.scheduler.preemptions_by_kind["swap"])
            eng.step()
            after = (eng.memory.num_compactions, eng.memory.num_grows, eng.memory.num_shrinks,
                     eng.scheduler.preemptions_by_kind["swap"])
            for name, b, a in zip(("compaction", "grow", "shrink", "swap"), before, after):
                if a > b:
                    seen.add(name)
            sizes.add(_same_kv(llm))
        assert seen == {"compaction", "grow", "shrink", "swap"}, seen
        assert eng.kv.num_blocks == 12 and len(sizes) > 1  # grew, then shrank back when idle
        assert _same_kv(llm) == 12
    finally:
        eng.shutdown()
