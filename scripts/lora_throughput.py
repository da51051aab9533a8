"""Output tok/s of a batch whose requests run 8 different LoRA adapters vs the same batch on the
base model alone (issue 29's target: >= 0.7x), side by side, reps interleaved.

    python scripts/lora_throughput.py                         # the shipped model
    python scripts/lora_throughput.py --model /tmp/llama-100m --batch 8 --max-tokens 64

Adapters: random adapters in PEFT's format (rank --rank on q/k/v/o/gate/up/down,
pagedllm/lora/random.py, into a temporary directory). ``--methods`` times the delta's three ways
(pagedllm/lora/ops.py): auto (by step size), dense, loop, gather; base-unfused is the
base model with the fused decoder-layer ops off, the path a step with adapters takes.

``--paged K``: the cost of unified paging (kv/adapters.py). A second engine whose KV pool
holds only K adapters' pages beside the batch's KV runs the same batch, each call with the
next ``--batch`` of ``--paged-adapters`` adapters, so every request pages its adapter in (and
an idle one out): tok/s beside the first engine's (all adapters resident), the page-ins, and
the time spent writing pages and copying them into compute slots.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch  # noqa: E402

from pagedllm import LLM, LoRARequest, SamplingParams, kernels  # before torch (_openmp.py)
from pagedllm.config import ModelConfig, default_model_path
from pagedllm.lora.random import write_random_adapter


def make_adapters(model: str, root: Path, n: int, rank: int) -> list[LoRARequest]:
    """``n`` random rank-``rank`` adapters on every projection, in PEFT's format
    (pagedllm/lora/random.py; B's std 0.1)."""
    cfg = ModelConfig.from_hf(model, "auto")
    return [LoRARequest(f"a{i}", i + 1, str(write_random_adapter(cfg, root / f"a{i}", rank, i,
                                                                 b_std=0.1)))
            for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--methods", default="auto", help="comma list of auto, dense, loop, gather")
    ap.add_argument("--paged", type=int, default=0, help="also run with a pool that holds K adapters")
    ap.add_argument("--paged-adapters", type=int, default=32)
    a = ap.parse_args()
    model = a.model or default_model_path()
    with tempfile.TemporaryDirectory() as tmp:
        loras = make_adapters(model, Path(tmp), a.adapters, a.rank)
        llm = LLM(model, enable_lora=True, max_loras=a.adapters, max_lora_rank=a.rank,
                  max_num_seqs=a.batch, enable_prefix_caching=False)
        runner = llm.engine.executor.driver
        assert runner.lora is not None
        prompts = [{"prompt_token_ids": [(7 * i + j) % 200 + 3 for j in range(a.prompt_len)]}
                   for i in range(a.batch)]
        sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
        mixed = [loras[i % len(loras)] for i in range(a.batch)]
        llm.generate(prompts, sp, use_tqdm=False, lora_request=mixed)  # warm-up, slots loaded
        llm.generate(prompts, sp, use_tqdm=False)
        cases = [("base", None, None), ("base-unfused", None, "unfused")] + [(f"lora-{m}", mixed, None if m == "auto" else m)
                                          for m in a.methods.split(",")]
        best: dict[str, float] = {}
        print("timing", flush=True)
        for _ in range(a.reps):
            for name, lr, method in cases:
                kernels.set_fused_ops(runner.model, method != "unfused", "fused_layer")
                runner.lora.method = None if method == "unfused" else method
                t0 = time.perf_counter()
                outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=lr)
                dt = time.perf_counter() - t0
                toks = sum(len(o.outputs[0].token_ids) for o in outs)
                best[name] = max(best.get(name, 0.0), toks / dt)
                print(f"  {name}: {toks / dt:.1f} tok/s", flush=True)
        if a.paged:
            kernels.set_fused_ops(runner.model, True, "fused_layer")
            runner.lora.method = None
            best.update(paged(a, model, Path(tmp), prompts, sp, llm, mixed))
        print(f"model={model} batch={a.batch} adapters={a.adapters} rank={a.rank} "
              f"prompt={a.prompt_len} max_tokens={a.max_tokens} threads={torch.get_num_threads()}")
        for name, tps in best.items():
            print(f"{name:12s} {tps:9.1f} output tok/s  {tps / best['base']:.2f}x base")


def paged(a: argparse.Namespace, model: str, root: Path, prompts: list, sp: SamplingParams,
          llm: LLM, mixed: list) -> dict[str, float]:
    """Best tok/s of ``llm`` (adapters resident) and of an engine whose pool holds ``a.paged``
    adapters, each call running the next ``a.batch`` of ``a.paged_adapters`` adapters."""
    many = make_adapters(model, root / "paged", a.paged_adapters, a.rank)
    probe = llm.engine.kv.adapters.sizes[mixed[0].lora_int_id]  # blocks one adapter takes
    bs = llm.engine.kv.block_size
    kv_blocks = a.batch * -(-(a.prompt_len + a.max_tokens) // bs)
    small = LLM(model, enable_lora=True, max_loras=a.batch, max_lora_rank=a.rank,
                max_num_seqs=a.batch, enable_prefix_caching=False, block_size=bs,
                num_kv_blocks=a.paged * probe + kv_blocks, max_model_len=a.prompt_len + a.max_tokens)
    lora = small.engine.executor.driver.lora
    assert lora is not None
    best: dict[str, float] = {}
    calls = 0
    small.generate(prompts, sp, use_tqdm=False, lora_request=[many[i] for i in range(a.batch)])
    for _ in range(a.reps):
        for name, engine in (("lora-resident", llm), (f"lora-paged-{a.paged}", small)):
            if engine is small:
                calls += 1
                lr = [many[(calls * a.batch + i) % len(many)] for i in range(a.batch)]
                ins0, s0 = lora.num_page_loads, lora.paging_s
            else:
                lr = mixed
            t0 = time.perf_counter()
            outs = engine.generate(prompts, sp, use_tqdm=False, lora_request=lr)
            dt = time.perf_counter() - t0
            toks = sum(len(o.outputs[0].token_ids) for o in outs)
            best[name] = max(best.get(name, 0.0), toks / dt)
            extra = ""
            if engine is small:
                extra = (f" ({lora.num_page_loads - ins0} page-ins, paging "
                         f"{1e3 * (lora.paging_s - s0):.1f} ms of {1e3 * dt:.0f} ms)")
            print(f"  {name}: {toks / dt:.1f} tok/s{extra}", flush=True)
    stats = small.kv_stats()
    print(f"paged engine: {stats['num_blocks']} blocks, {probe} per adapter, "
          f"{stats['lora_page_ins']} page-ins, {stats['lora_page_outs']} page-outs, "
          f"{lora.page_bytes_loaded / 2**20:.1f} MiB written, {lora.paging_s * 1e3:.0f} ms paging")
    return best


if __name__ == "__main__":
    main()
