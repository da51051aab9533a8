"""Old vs new pagedllm on one beam search workload, interleaved: ``LLM.beam_search`` wall time.

Two checkouts (``--old DIR --new DIR``): each round runs each checkout in a fresh process
(``PYTHONPATH=<checkout>``, this Python), alternating which goes first; a process builds the
engine, warms up on one short search, then times the workload once. ``--no-holds`` (new only):
the driver asks for no held KV, so every round request recomputes its prefix (prefix caching
off), to show what holds save. Reports the median wall and CPU time per checkout and new/old;
the beams (token ids and scores) must be identical across all runs.

    python scripts/ab_beam_search.py --old /work/main --new . --rounds 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import hashlib, json, random, sys, time
import torch
a = json.loads(sys.argv[1])
torch.set_num_threads(a["threads"])
from pagedllm import LLM
if a["no_holds"]:
    import pagedllm.engine.beam as beam
    beam.KEEP_KV_S = None
rng = random.Random(a["seed"])
prompts = [{"prompt_token_ids": [rng.randrange(4, 4000) for _ in range(rng.randrange(16, 64))]}
           for _ in range(a["num_prompts"])]
llm = LLM(model=a["model"], kv_cache_memory="1GiB", max_model_len=512,
          enable_prefix_caching=not a["no_holds"])
llm.beam_search(prompts[:1], beam_width=2, max_tokens=4)
c0, w0 = time.process_time(), time.perf_counter()
outs = llm.beam_search(prompts, beam_width=a["width"], max_tokens=a["max_tokens"])
cpu, wall = time.process_time() - c0, time.perf_counter() - w0
beams = [[[s.token_ids, s.cumulative_logprob] for s in o.sequences] for o in outs]
print(json.dumps({"wall_s": wall, "cpu_s": cpu, "steps": llm.engine.scheduler.num_steps,
                  "beams": hashlib.sha1(json.dumps(beams).encode()).hexdigest()}), flush=True)
"""


def run(tree: str, args: argparse.Namespace, no_holds: bool = False) -> dict:
    a = {"model": args.model, "threads": args.threads, "seed": 0, "no_holds": no_holds,
         "num_prompts": args.num_prompts, "width": args.width, "max_tokens": args.max_tokens}
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(a)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old", required=True, help="checkout (repository root) of the old code")
    p.add_argument("--new", required=True, help="checkout of the new code")
    p.add_argument("--model", default=None, help="checkpoint (default: the new checkout's "
                   "shipped model)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-holds", action="store_true",
                   help="also run the new checkout without held KV (recomputed prefixes)")
    args = p.parse_args()
    if args.model is None:
        args.model = os.path.join(os.path.abspath(args.new), "pagedllm/assets/default_model")
    runs: dict[str, list[dict]] = {"old": [], "new": [], "new-no-holds": []}
    for r in range(args.rounds):
        order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
        if args.no_holds:
            order.append("new-no-holds")
        for name in order:
            res = run(args.old if name == "old" else args.new, args, name == "new-no-holds")
            runs[name].append(res)
            print(f"round {r} {name}: wall {res['wall_s']:.3f} s, cpu {res['cpu_s']:.3f} s, "
                  f"{res['steps']} steps", flush=True)
    hashes = {res["beams"] for rs in runs.values() for res in rs}
    med = {k: (statistics.median(x["wall_s"] for x in v), statistics.median(x["cpu_s"] for x in v))
           for k, v in runs.items() if v}
    for k, (w, c) in med.items():
        print(f"{k}: median wall {w:.3f} s, cpu {c:.3f} s")
    print(f"new/old: wall {med['new'][0] / med['old'][0]:.3f}x, "
          f"cpu {med['new'][1] / med['old'][1]:.3f}x")
    if args.no_holds:
        print(f"new-no-holds/new: wall {med['new-no-holds'][0] / med['new'][0]:.3f}x")
    print("beams identical across runs" if len(hashes) == 1 else f"BEAMS DIFFER: {len(hashes)}")
    return 0 if len(hashes) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
