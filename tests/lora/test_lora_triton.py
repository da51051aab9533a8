"""The CUDA LoRA kernels (lora/triton_ops.py) against the per-token reference, in Triton's
interpreter on CPU tensors (TRITON_INTERPRET must be set before triton is first imported)."""

from __future__ import annotations

from triton_env import DEVICE  # first: sets TRITON_INTERPRET before triton is imported

# isort: split
import pytest
import torch
from torch import nn

from pagedllm.lora.ops import LoRAMapping, LoRAStack

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")  # a lane read out of bounds


def _reference(stack: LoRAStack, slots: list[int], x: torch.Tensor) -> torch.Tensor:
    r, out = stack.rank, []
    for t, s in enumerate(slots):
        out.append(torch.cat([b[s] @ (stack.a[s, j * r:(j + 1) * r] @ x[t])
                              for j, b in enumerate(stack.b)]))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(3, 4, 16, [8, 4, 4]), (2, 16, 100, [70]), (4, 5, 130, [40, 40])])
def test_triton_delta_matches_per_token_reference(shape: tuple, dtype: torch.dtype) -> None:
    """Slots, rank, input width and shard widths that are not tile multiples (masks), base
    tokens (the zero slot) among adapter tokens, fp32 and fp16 weights."""
    s, r, d, sizes = shape
    torch.manual_seed(0)
    a = torch.randn(s + 1, len(sizes) * r, d)
    b = [torch.randn(s + 1, o, r) for o in sizes]
    a[s].zero_()
    for bj in b:
        bj[s].zero_()
    b_flat = [bj[:s].transpose(1, 2).reshape(s * r, -1).contiguous() for bj in b]
    stack = LoRAStack(a.to(DEVICE, dtype), [bj.to(DEVICE, dtype) for bj in b],
                      [sum(sizes[:j]) for j in range(len(sizes))], r,
                      [bf.to(DEVICE, dtype) for bf in b_flat])
    linear = nn.Linear(d, sum(sizes))
    slots = [k % (s + 1) for k in range(7)]  # every slot, the base (s) included
    x = torch.randn(len(slots), d).to(DEVICE, dtype)
    y = torch.randn(len(slots), sum(sizes)).to(DEVICE, dtype)
    ts = torch.tensor(slots, device=DEVICE)
    mapping = LoRAMapping(ts, [], {linear: stack}, "triton")
    got = mapping.apply(linear, x, y.clone())
    ref = _reference(LoRAStack(a, b, stack.offsets, r, b_flat), slots, x.float().cpu())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float().cpu(), y.float().cpu() + ref, atol=tol * 10, rtol=tol)


def test_engine_with_the_triton_method_matches_hf_peft(lora_base, adapters) -> None:  # type: ignore[no-untyped-def]
    """The engine's step with every adapter delta on the Triton kernels (forced on CPU tensors in
    the interpreter; the engine on the GPU elsewhere): tokens equal HF + PEFT for a mixed batch."""
    from test_lora_engine import GREEDY, _expected, _requests

    from pagedllm import LLM

    loras = _requests(adapters)
    prompts = [[5 + (3 * i + j) % 90 for j in range(5 + i)] for i in range(len(loras))]
    llm = LLM(str(lora_base), enable_lora=True, max_lora_rank=16, max_loras=4, num_kv_blocks=64,
              block_size=16, dtype="float32", max_model_len=64, device=DEVICE)
    llm.engine.executor.driver.lora.method = "triton"
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                        lora_request=loras)
    assert [list(o.outputs[0].token_ids) for o in outs] == _expected(lora_base, loras, prompts)
