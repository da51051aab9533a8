"""Where the wall time of ``bench throughput``'s pagedllm run goes, by part and step kind.

    python scripts/step_breakdown.py MODEL DTYPE [fused_layers=0] [reps=2]

Builds the engine as ``bench throughput --backends pagedllm --kv-cache-memory 4GiB`` does, runs
the same 64-request longtail workload (after the same 4-request warm-up), and times every
engine call of interest with ``perf_counter`` wrappers: the step, schedule / update / output
processing, batch preparation, the forward and inside it the embedding, the decoder-layer ops
(``attn_in``, attention, ``attn_out_mlp``; with ``fused_layers=0`` the modules: linears, norms,
rotary, SiLU), the final norm, the LM head, sampling. Steps are split into decode-only and
mixed (prefill) steps. Prints the fastest rep's table (README "Where a 125M step's time goes").
Timing wrappers cost ~1 us a call: read small rows with that in mind.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import time
from typing import Any

import torch

import pagedllm.models.llama as llama
import pagedllm.runner.model_runner as mr
from pagedllm.args import EngineArgs
from pagedllm.bench.baselines import EngineBackend
from pagedllm.bench.workload import build_workload
from pagedllm.layers.linear import Linear

T: dict[tuple[str, str], float] = collections.defaultdict(float)  # (step kind, part) -> s
N: dict[tuple[str, str], int] = collections.defaultdict(int)
cur = {"kind": "?", "on": False}


def wrap(obj: Any, name: str, part: str) -> None:
    f = getattr(obj, name, None)
    if f is None:  # the engine moved on since this row was written: say so, time the rest
        print(f"not timed (no {type(obj).__name__}.{name}): {part}", file=sys.stderr)
        return

    def timed(*a: Any, **k: Any) -> Any:
        if not cur["on"]:
            return f(*a, **k)
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            T[(str(cur["kind"]), part)] += time.perf_counter() - t0
            N[(str(cur["kind"]), part)] += 1

    setattr(obj, name, timed)


def instrument(be: EngineBackend, fused_layers: bool) -> None:
    eng = be.engine
    runner, sched = eng.runner, eng.scheduler
    schedule = sched.schedule

    def timed_schedule(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        out = schedule(*a, **k)
        s = out.scheduled
        nt = sum(x.num_new_tokens for x in s)
        kind = "decode" if s and nt == len(s) else ("mixed" if s else "empty")
        cur["kind"] = kind
        T[(kind, "schedule")] += time.perf_counter() - t0
        T[(kind, "rows")] += len(s)
        T[(kind, "tokens")] += nt
        if kind == "decode":
            T[("ctx", "ctx")] += sum(x.end for x in s)
        return out

    sched.schedule = timed_schedule  # type: ignore[method-assign]
    for obj, name, part in [
        (eng, "step", "STEP"), (sched, "update", "sched.update"), (sched, "end_step", "sched.end_step"),
        (eng.structured, "masks", "structured.masks"), (eng.output, "process", "output.process"),
        (eng, "_close", "stats.close"), (eng.executor, "execute", "EXECUTE"),
        (runner, "prepare", "prepare"), (runner.uploader, "metadata", "metadata"),
        (runner, "run_forward", "FORWARD"), (runner, "apply_kv_update", "apply_kv_update"),
        (runner.model.model.embed_tokens, "forward", "fwd.embed"),
        (runner.model.model.rotary_emb, "forward", "fwd.rotary_table"),
        (runner.model.model.norm, "add_norm", "fwd.final_norm"),
        (runner.model, "compute_logits", "logits (lm_head)"),
        (mr, "sampling_metadata", "sampling_metadata"), (mr, "sample", "sample"),
        (mr, "fetch", "fetch + tolist"), (mr.verify, "accept", "verify.accept"),
    ]:
        wrap(obj, name, part)
    m = runner.model
    if fused_layers:
        for op in ("attn_in", "attn_out_mlp"):
            wrap(torch.ops.pagedllm, op, "fwd." + op)
        for layer in m.model.layers:
            wrap(layer, "attend", "fwd.attention")
        return
    for mod in m.modules():
        if isinstance(mod, Linear) and mod is not m.lm_head:
            wrap(mod, "matmul", "fwd.linears")
    wrap(runner.backend, "forward", "fwd.attention (KV write + attend)")
    for layer in m.model.layers:
        wrap(layer.input_layernorm, "add_norm", "fwd.norms")
        wrap(layer.post_attention_layernorm, "add_norm", "fwd.norms")
        wrap(layer.mlp.act, "forward", "fwd.silu_and_mul")
    wrap(llama, "apply_rotary_qk", "fwd.rotary")


def main() -> None:
    model, dtype = sys.argv[1], sys.argv[2]
    opts = dict(a.split("=", 1) for a in sys.argv[3:])
    fused_layers = opts.get("fused_layers", "1") != "0"
    kw = dataclasses.asdict(EngineArgs.from_kwargs(dict(
        model=model, dtype=dtype, kv_cache_memory="4GiB", fused_layers=fused_layers)))
    _, reqs, _ = build_workload(kw, dict(kind="longtail", num_prompts=64, seed=kw.get("seed", 0)))
    be = EngineBackend("pagedllm", kw)
    instrument(be, fused_layers)
    be.run(reqs[:4])
    best: tuple[float, float, dict, dict, int, int] | None = None
    for _ in range(int(opts.get("reps", 2))):
        T.clear()
        N.clear()
        cur["on"] = True
        t0, c0 = time.perf_counter(), time.process_time()
        res = be.run(reqs)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        cur["on"] = False
        if best is None or wall < best[0]:
            best = (wall, cpu, dict(T), dict(N), res.output_tokens, res.stats["num_steps"])
    assert best is not None
    wall, cpu, t, n, out_toks, steps = best
    print(f"{model} {dtype} {opts}: wall {wall:.3f} s, cpu {cpu:.3f} s, {out_toks / wall:.1f} "
          f"out tok/s, {steps} steps, {torch.get_num_threads()} threads")
    for kind in ("decode", "mixed", "empty"):
        rows = {p: v for (k, p), v in t.items() if k == kind}
        steps_k = n.get((kind, "STEP"), 0)
        if not steps_k:
            continue
        print(f"\n== {kind}: {steps_k} steps, {rows['rows'] / steps_k:.1f} rows and "
              f"{rows['tokens'] / steps_k:.1f} tokens a step, {rows['STEP']:.3f} s "
              f"({rows['STEP'] / wall:.1%} of wall)")
        for p, v in sorted(rows.items(), key=lambda x: -x[1]):
            if p not in ("rows", "tokens"):
                print(f"  {p:34s} {v * 1e3:9.1f} ms {v / rows['STEP']:6.1%} "
                      f"{v / steps_k * 1e6:9.1f} us/step")
    if t.get(("decode", "rows")):
        print(f"\ndecode: mean context {t.get(('ctx', 'ctx'), 0) / t[('decode', 'rows')]:.1f}")
    in_steps = sum(v for (k, p), v in t.items() if p == "STEP")
    print(f"outside step() (the benchmark loop, add_request): {(wall - in_steps) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
