"""``bench kernel``: paged attention (an attention backend over block tables) vs contiguous SDPA.

Same data both ways: K/V of ``batch`` requests of ``context`` tokens, once scattered over a
shuffled block pool ``[num_blocks, block_size, Hkv, D]`` (paged), once laid out contiguously
``[batch, Hkv, context, D]``. Both sides write the step's new K/V first (paged: slot scatter;
contiguous: a slice copy), then attend:

- decode: one new token per request; contiguous = one SDPA call with the GQA group folded into
  the query axis ``q[batch, Hkv, group, D]`` (the fastest CPU formulation);
- prefill: one request, ``context`` new tokens, causal; contiguous = SDPA ``is_causal``, GQA.

Timing: ``rounds`` rounds, each ``iters`` calls of paged then ``iters`` of contiguous (order
alternating per round); the median round gives the per-call time. ratio = paged / contiguous.
``gather_ms`` times the paged side's block-table gather of K and V alone (the CPU backend copies
the blocks into a dense tensor before SDPA): it is the part of the paged time contiguous skips.
``contiguous_masked_ms`` is contiguous decode with the boolean length mask that a batch of
ragged lengths needs (the paged backend always masks batched decode): SDPA's masked path.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from pagedllm.bench.report import (
    format_table,
    machine_info,
    plot,
    print_targets,
    targets,
    write_json,
)

COLUMNS = ("phase", "context", "block_size", "batch", "paged_ms", "contiguous_ms", "ratio",
           "gather_ms", "contiguous_masked_ms")


def _case(phase: str, batch: int, context: int, block_size: int, hq: int, hkv: int, d: int,
          backend_name: str, seed: int) -> tuple[Any, Any, Any, Any]:
    """Closures (paged, contiguous, gather, masked): the same attention step both ways, the
    paged side's K/V gather through the block tables alone (where the paged overhead goes on
    CPU), and contiguous decode with a length mask."""
    import torch
    import torch.nn.functional as F

    from pagedllm.attention import AttentionMetadata, get_backend

    g = torch.Generator().manual_seed(seed)
    per_req = -(-context // block_size)
    nb = batch * per_req + 1
    k_cont = torch.randn(batch, hkv, context, d, generator=g)
    v_cont = torch.randn(batch, hkv, context, d, generator=g)
    perm = torch.randperm(nb, generator=g)[:batch * per_req].view(batch, per_req).to(torch.int32)
    k_cache = torch.zeros(nb, block_size, hkv, d)
    v_cache = torch.zeros(nb, block_size, hkv, d)
    pos = torch.arange(context)
    slots = (perm.long()[:, pos // block_size] * block_size + pos % block_size)  # [B, L]
    k_cache.view(-1, hkv, d)[slots.reshape(-1)] = k_cont.permute(0, 2, 1, 3).reshape(-1, hkv, d)
    v_cache.view(-1, hkv, d)[slots.reshape(-1)] = v_cont.permute(0, 2, 1, 3).reshape(-1, hkv, d)
    backend = get_backend(backend_name, "cpu")
    scale = d ** -0.5
    group = hq // hkv
    if phase == "decode":
        q = torch.randn(batch, hq, d, generator=g)
        k_new = k_cont[:, :, -1].clone()  # [B, Hkv, D]: rewrite the last position
        v_new = v_cont[:, :, -1].clone()
        qsl = list(range(batch + 1))
        lens = [context] * batch
        slot_map = slots[:, -1].contiguous()
    else:
        if batch != 1:
            raise ValueError("prefill cases use one request")
        q = torch.randn(context, hq, d, generator=g)
        k_new = k_cont[0].transpose(0, 1).clone()  # [L, Hkv, D]
        v_new = v_cont[0].transpose(0, 1).clone()
        qsl = [0, context]
        lens = [context]
        slot_map = slots[0].contiguous()
    meta = AttentionMetadata(
        slot_mapping=slot_map,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=perm,
        max_query_len=qsl[1] - qsl[0],
        max_seq_len=context,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=lens,
    )

    def paged() -> Any:
        return backend.forward(q, k_new, v_new, k_cache, v_cache, meta, scale)

    if phase == "decode":
        def contiguous() -> Any:
            k_cont[:, :, -1] = k_new
            v_cont[:, :, -1] = v_new
            qg = q.view(batch, hkv, group, d)
            return F.scaled_dot_product_attention(qg, k_cont, v_cont, scale=scale).reshape(batch, hq, d)

        keep = torch.ones(batch, 1, 1, context, dtype=torch.bool)

        def masked() -> Any:  # contiguous, with the length mask ragged batches need
            k_cont[:, :, -1] = k_new
            v_cont[:, :, -1] = v_new
            qg = q.view(batch, hkv, group, d)
            return F.scaled_dot_product_attention(qg, k_cont, v_cont, attn_mask=keep,
                                                  scale=scale).reshape(batch, hq, d)
    else:
        def contiguous() -> Any:
            k_cont[0] = k_new.transpose(0, 1)
            v_cont[0] = v_new.transpose(0, 1)
            qi = q.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qi, k_cont, v_cont, is_causal=True, scale=scale,
                                               enable_gqa=True)
            return o[0].transpose(0, 1)

        masked = contiguous  # a single request needs no length mask

    tables = perm.long()

    def gather() -> Any:  # what the CPU backend materialises before its SDPA call
        return k_cache[tables].float(), v_cache[tables].float()

    with torch.inference_mode():
        a, b = paged(), contiguous()
    err = (a.reshape(b.shape) - b).abs().max().item()
    if err > 1e-3:
        raise AssertionError(f"paged and contiguous attention disagree ({phase}, context "
                             f"{context}, block {block_size}): max abs diff {err:.2e}")
    return paged, contiguous, gather, masked


def _time(fn: Any, iters: int) -> float:
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters


def run_kernel(
    contexts: tuple[int, ...] = (128, 512, 2048),
    block_sizes: tuple[int, ...] = (16, 64, 256),
    batch: int = 16,
    phases: tuple[str, ...] = ("decode", "prefill"),
    num_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    rounds: int = 5,
    iters: int = 10,
    backend: str = "cpu",
    seed: int = 0,
) -> dict[str, Any]:
    import torch

    rows: list[dict[str, Any]] = []
    with torch.inference_mode():
        for phase in phases:
            for ctx in contexts:
                for bs in block_sizes:
                    b = batch if phase == "decode" else 1
                    paged, cont, gather, masked = _case(phase, b, ctx, bs, num_heads,
                                                        num_kv_heads, head_dim, backend, seed)
                    paged(), cont(), gather(), masked()  # warm-up
                    tp, tc, tg, tm = [], [], [], []
                    for r in range(rounds):
                        if r % 2 == 0:
                            tp.append(_time(paged, iters))
                            tc.append(_time(cont, iters))
                        else:
                            tc.append(_time(cont, iters))
                            tp.append(_time(paged, iters))
                        tg.append(_time(gather, iters))
                        tm.append(_time(masked, iters))
                    p_ms, c_ms = 1e3 * statistics.median(tp), 1e3 * statistics.median(tc)
                    ratios = [x / y for x, y in zip(tp, tc)]
                    rows.append({"phase": phase, "context": ctx, "block_size": bs, "batch": b,
                                 "paged_ms": p_ms, "contiguous_ms": c_ms,
                                 "gather_ms": 1e3 * statistics.median(tg),
                                 "contiguous_masked_ms": 1e3 * statistics.median(tm),
                                 "ratio": statistics.median(ratios),
                                 "ratio_min": min(ratios), "ratio_max": max(ratios)})
    summary = {}
    for phase in phases:
        rs = [r["ratio"] for r in rows if r["phase"] == phase]
        if rs:
            summary[phase] = {"median_ratio": statistics.median(rs), "max_ratio": max(rs)}
    return {
        "benchmark": "kernel",
        "backend": backend,
        "shape": {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
                  "dtype": "float32", "decode_batch": batch},
        "timing": {"rounds": rounds, "iters": iters, "order": "alternating per round"},
        "results": rows,
        "summary": summary,
        "targets": targets([("paged/contiguous decode time (worst case)",
                             summary["decode"]["max_ratio"] if "decode" in summary else None,
                             "<=", 1.3)]),
        "machine": machine_info(),
    }


def report_kernel(res: dict[str, Any], output_dir: Path, output_json: Path | None,
                  make_plots: bool = True) -> list[Path]:
    s = res["shape"]
    print(f"{res['backend']} backend vs contiguous SDPA; {s['num_heads']} q heads, "
          f"{s['num_kv_heads']} kv heads, head_dim {s['head_dim']}, {s['dtype']}")
    print(format_table(res["results"], COLUMNS,
                       ["phase", "context", "block", "batch", "paged ms", "contig ms",
                        "paged/contig", "gather ms", "contig+mask ms"]))
    for phase, v in res["summary"].items():
        print(f"{phase}: median ratio {v['median_ratio']:.2f}, worst {v['max_ratio']:.2f}")
    print_targets(res["targets"])
    paths = [write_json(output_json or output_dir / "kernel.json", res)]
    if make_plots:
        rows = res["results"]

        def draw(plt: Any) -> None:
            for phase, style in (("decode", "-"), ("prefill", "--")):
                for bs in sorted({r["block_size"] for r in rows}):
                    pts = [(r["context"], r["ratio"]) for r in rows
                           if r["phase"] == phase and r["block_size"] == bs]
                    if pts:
                        plt.plot(*zip(*pts), style, marker="o", label=f"{phase}, block {bs}")
            plt.axhline(1.0, color="gray", lw=0.8)
            plt.xscale("log", base=2)
            plt.xlabel("context length (tokens)")
            plt.ylabel("paged / contiguous time")
            plt.legend(fontsize=8)
            plt.title("paged attention vs contiguous SDPA")

        p = plot(output_dir / "kernel.png", draw)
        if p:
            paths.append(p)
    return paths
