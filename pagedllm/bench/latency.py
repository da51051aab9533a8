"""``bench latency``: single-request and small-batch decode speed, speculative decoding on vs off.

One invocation builds two engines from the same kwargs, one without speculation and one with
``speculative_config`` (the flag's, or n-gram k = 4 when it is not given), warms both up, then
for each batch size b runs b requests at once (greedy, ``ignore_eos``, ``--output-len`` tokens)
``reps`` times per engine, interleaved (``bench.harness``). Each run starts with an empty prefix
cache. The prompts are code: windows of ``--prompt-len`` tokens from the middle of the shipped
model's held-out files (the ``code`` workload, ``bench.workload``), or seeded random ids with
``--random-prompts`` (the ``fixed`` workload; nothing repeats: the case where proposals are
rarely right).

Reported per (batch, engine):

    output_tokens_per_s   b * output_len / elapsed of the fastest repetition (prefill included)
    decode_tokens_per_s   tokens after each request's first / time from the last first token
                          to the end (the decode phase alone)
    acceptance_rate, mean_accepted_length   the speculating engine's counts over its runs
and the ratio on/off of each rate, with the greedy outputs compared token for token.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from pagedllm.args import EngineArgs
from pagedllm.bench.command import add_output_args, engine_kwargs, int_list, prepare, show
from pagedllm.bench.harness import interleaved, timing
from pagedllm.bench.report import format_table, machine_info, plot, write_json
from pagedllm.bench.workload import BenchRequest, code_prompts, submissions

__all__ = ["code_prompts", "report_latency", "run_latency"]

DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                "prompt_lookup_min": 1}
COLUMNS = ("batch", "speculation", "output_tokens_per_s", "decode_tokens_per_s", "ratio_output",
           "ratio_decode", "acceptance_rate", "mean_accepted_length")


COMMAND = "latency"
HELP = "single-request and small-batch decode speed, speculative decoding on vs off, interleaved"


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-sizes", type=int_list, default=(1, 4, 16))
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--reps", type=int, default=3, help="repetitions per engine (the fastest is reported)")
    p.add_argument("--random-prompts", action="store_true",
                   help="seeded random token ids (the fixed workload) instead of held-out code "
                   "(nothing repeats)")
    add_output_args(p)
    EngineArgs.add_cli_args(p)


def run(a: argparse.Namespace) -> int:
    from pagedllm.bench.workload import build_workload

    prepare(a)
    kw = engine_kwargs(a)
    _, reqs, cfg = build_workload(kw, dict(
        kind="fixed" if a.random_prompts else "code", num_prompts=max(a.batch_sizes),
        seed=a.seed, input_len=a.prompt_len, output_len=a.output_len))
    prompts = [r.prompt_token_ids for r in reqs]
    spec = cfg.speculative
    spec_dict = dataclasses.asdict(spec) if spec is not None else None
    res = run_latency(prompts, kw, spec_dict, tuple(a.batch_sizes), a.output_len, a.reps)
    return show(report_latency(res, a.output_dir, a.output_json, a.plot))


class _Engine:
    def __init__(self, engine_kwargs: dict[str, Any], spec: dict[str, Any] | None) -> None:
        from pagedllm.engine import LLMEngine

        self.spec = spec
        self.engine = LLMEngine.from_args(**{**engine_kwargs, "speculative_config": spec})

    def run(self, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
        from pagedllm.engine.drive import drive

        eng = self.engine
        eng.kv.reset_prefix_cache()  # a repetition must not hit the previous one's blocks
        before = eng.kv_stats()
        subs = submissions(eng, [BenchRequest(p, output_len) for p in prompts], prefix="l")
        res = drive(eng, subs)
        after = eng.kv_stats()
        counts = {k: after[f"spec_decode_{k}"] - before[f"spec_decode_{k}"]
                  for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
        return {"elapsed_s": res.elapsed, "decode_s": res.elapsed - max(res.first_token.values()),
                "outputs": [list(o.outputs[0].token_ids)
                            for o in res.in_order([r.request_id for r in subs])], **counts}


def run_latency(prompts: list[list[int]], engine_kwargs: dict[str, Any],
                spec: dict[str, Any] | None, batch_sizes: tuple[int, ...], output_len: int,
                reps: int = 3) -> dict[str, Any]:
    if max(batch_sizes) > len(prompts):
        raise ValueError(f"--batch-sizes up to {max(batch_sizes)} need that many prompts")
    spec = spec or DEFAULT_SPEC
    engines = [_Engine(engine_kwargs, None), _Engine(engine_kwargs, spec)]
    for e in engines:  # warm-up: kernels compiled, weights packed, allocator primed
        e.run(prompts[:2], 8)
    results: list[dict[str, Any]] = []
    agreement: dict[int, float] = {}
    for b in batch_sizes:
        batch = prompts[:b]

        def one(e: _Engine, batch: list[list[int]] = batch) -> dict[str, Any]:
            return e.run(batch, output_len)

        off, on = interleaved(engines, one, reps)
        rows = []
        for name, runs in (("off", off), ("on", on)):
            t = timing([r["elapsed_s"] for r in runs])
            decode = min(r["decode_s"] for r in runs)
            drafts = sum(r["num_drafts"] for r in runs)
            proposed = sum(r["num_draft_tokens"] for r in runs)
            accepted = sum(r["num_accepted_tokens"] for r in runs)
            rows.append({
                "batch": b, "speculation": name,
                "output_tokens_per_s": b * output_len / t["elapsed_s"],
                "decode_tokens_per_s": b * (output_len - 1) / decode if decode > 0 else None,
                "acceptance_rate": accepted / proposed if proposed else None,
                "mean_accepted_length": 1 + accepted / drafts if drafts else None,
                "num_draft_tokens": proposed, "num_accepted_tokens": accepted, **t,
            })
        for key, ratio in (("output_tokens_per_s", "ratio_output"),
                           ("decode_tokens_per_s", "ratio_decode")):
            if rows[0][key] and rows[1][key]:
                rows[1][ratio] = rows[1][key] / rows[0][key]
        results += rows
        agreement[b] = sum(x == y for x, y in zip(off[0]["outputs"], on[0]["outputs"])) / b
    return {
        "benchmark": "latency",
        "results": results,
        "greedy_output_agreement": agreement,
        "speculative_config": spec,
        "output_len": output_len,
        "prompt_len": len(prompts[0]),
        "reps": reps,
        "order": "interleaved: rep r runs the engines rotated by r",
        "engine": {k: v for k, v in engine_kwargs.items()
                   if v is not None and k != "speculative_config"},
        "machine": machine_info(),
    }


def report_latency(res: dict[str, Any], output_dir: Path, output_json: Path | None,
                   make_plots: bool = True) -> list[Path]:
    print(format_table(res["results"], COLUMNS,
                       ["batch", "spec", "out tok/s", "decode tok/s", "on/off out", "on/off decode",
                        "accept rate", "tokens/verify"]))
    agree = res["greedy_output_agreement"]
    print("greedy outputs identical on/off: "
          + ", ".join(f"batch {b}: {a:.0%}" for b, a in agree.items()))
    paths = [write_json(output_json or output_dir / "latency.json", res)]
    if make_plots:
        rows = [r for r in res["results"] if r["speculation"] == "on"]

        def draw(plt: Any) -> None:
            plt.plot([r["batch"] for r in rows], [r.get("ratio_output") for r in rows], marker="o",
                     label="output tok/s, on / off")
            plt.axhline(1.0, color="gray", lw=0.8)
            plt.xscale("log", base=2)
            plt.xlabel("requests in the batch")
            plt.ylabel("speed-up")
            plt.legend()
            plt.title(f"speculative decoding ({res['speculative_config'].get('method')})")

        p = plot(output_dir / "latency.png", draw)
        if p:
            paths.append(p)
    return paths
