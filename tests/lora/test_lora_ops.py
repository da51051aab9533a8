"""The batched LoRA delta (lora/ops.py) against a plain per-token reference, both methods, and
the scheduler's max_loras admission (pure Python)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedllm.lora.ops import LoRAMapping, LoRAStack


def _reference(stack: LoRAStack, slots: list[int], x: torch.Tensor) -> torch.Tensor:
    out = []
    r = stack.rank
    for t, s in enumerate(slots):
        parts = [b[s] @ (stack.a[s, j * r:(j + 1) * r] @ x[t]) for j, b in enumerate(stack.b)]
        out.append(torch.cat(parts))
    return torch.stack(out)


@pytest.mark.parametrize("method", ["dense", "dense-gemm", "loop", "gather"])
def test_delta_matches_per_token_reference(method: str) -> None:
    """``dense-gemm``: the dense method on pagedllm's packed GEMM (the engine's choice on CPU)."""
    torch.manual_seed(0)
    s, r, d, sizes = 3, 4, 16, [8, 4, 4]  # 3 slots + the zero base slot, a qkv-like linear
    a = torch.randn(s + 1, len(sizes) * r, d)
    b = [torch.randn(s + 1, o, r) for o in sizes]
    a[s].zero_()
    for bj in b:
        bj[s].zero_()
    b_flat = [bj[:s].transpose(1, 2).reshape(s * r, -1).contiguous() for bj in b]  # as the manager
    stack = LoRAStack(a, b, [0, 8, 12], r, b_flat)
    if method == "dense-gemm":
        from pagedllm.layers.linear import gemm_dtypes

        if torch.float32 not in gemm_dtypes():
            pytest.skip("pagedllm's CPU kernels are not built here")
        stack.pack(s)
        method = "dense"
    linear = nn.Linear(d, sum(sizes))
    slots = [2, 2, 0, 3, 0, 2, 1, 3, 3]  # base (3) and adapters interleaved
    x = torch.randn(len(slots), d)
    y = torch.randn(len(slots), sum(sizes))
    ts = torch.tensor(slots)
    groups = [(k, (ts == k).nonzero().flatten(), frozenset({linear})) for k in (0, 1, 2)]
    onehot = torch.nn.functional.one_hot(ts, s + 1)[:, :-1].float().unsqueeze(-1)
    mapping = LoRAMapping(ts, groups, {linear: stack}, method, onehot)
    got = mapping.apply(linear, x, y.clone())
    torch.testing.assert_close(got, y + _reference(stack, slots, x))
    other = nn.Linear(d, sum(sizes))  # a linear no adapter targets: unchanged
    assert torch.equal(mapping.apply(other, x, y.clone()), y)


def test_scheduler_runs_at_most_max_loras_per_step_fcfs() -> None:
    """max_loras=1: each step runs one adapter (plus base requests); the adapters take turns in
    arrival order, and every request finishes in a bounded number of steps."""
    from pagedllm.config import SchedulerConfig
    from pagedllm.kv.manager import KVCacheManager
    from pagedllm.lora import LoRARequest
    from pagedllm.request import Request
    from pagedllm.sampling_params import SamplingParams
    from pagedllm.sched import Scheduler

    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                                      max_loras=1), KVCacheManager(64, 4))
    loras = [LoRARequest(f"a{i}", i, f"/a{i}") for i in (1, 2, 3)]
    for lr in loras:
        sched.kv.adapters.register(lr.lora_int_id, 3)  # its weights take 3 blocks when paged in
    reqs = []
    for i in range(9):
        r = Request(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=3))
        r.lora_request = None if i % 4 == 3 else loras[i % 3]
        sched.add_request(r)
        reqs.append(r)
    order: list[int] = []
    for _ in range(100):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        ids = {s.request.lora_request.lora_int_id for s in out.scheduled if s.request.lora_request}
        assert len(ids) <= 1
        order += [i for i in ids if not order or order[-1] != i]
        sched.update(out, {s.request.request_id: 9 for s in out.scheduled if s.samples})
        sched.kv.check_integrity()
    assert not sched.has_unfinished_requests()
    assert order[:3] == [1, 2, 3]  # turns in arrival order: nobody starves
