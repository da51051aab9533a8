"""What watching the KV inspector costs the engine: one in-process `pagedllm serve --kv-inspector`,
the same workload run again and again (`bench serve`'s client, all requests at once), alternately
with no viewer and with a viewer reading /kv/stream as the page does; output tokens/s of each,
side by side in one run, and the time the engine thread spent taking snapshots.

    python scripts/kv_inspector_cost.py [--model M] [--num-prompts 64] [--reps 4] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import threading
import time
from typing import Any


def _serve(app: Any) -> tuple[Any, threading.Thread, str]:
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


def _viewer(base_url: str, stop: threading.Event, seen: list[int]) -> None:
    """Read /kv/stream as the page does (parse every message, reconnect when a stream ends)."""
    import httpx

    after_t, after_e = 0.0, 0
    while not stop.is_set():
        with httpx.stream("GET", base_url + "/kv/stream", timeout=60,
                          params={"history_after": after_t, "events_after": after_e}) as s:
            for line in s.iter_lines():
                if line.startswith("data: "):
                    msg = json.loads(line[6:])
                    seen.append(msg["state"]["seq"])
                    if msg["history"]:
                        after_t = msg["history"][-1][0]
                    if msg["events"]:
                        after_e = msg["events"][-1][0]
                if stop.is_set():
                    break


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the shipped model")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--reps", type=int, default=4, help="runs of each mode, interleaved")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kv-cache-memory", default="64MiB")
    args = p.parse_args()

    import torch

    from pagedllm.bench.serve import run_serve
    from pagedllm.bench.workload import WorkloadSpec, make_workload, vocab_ids
    from pagedllm.config import default_model_path
    from pagedllm.engine import LLMEngine
    from pagedllm.server.api import build_app

    torch.set_num_threads(args.threads)
    model = args.model or default_model_path()
    engine = LLMEngine.from_args(model=str(model), kv_cache_memory=args.kv_cache_memory)
    tok = engine.tokenizer
    reqs = make_workload(WorkloadSpec(num_prompts=args.num_prompts,
                                      max_model_len=engine.config.scheduler.max_model_len),
                         vocab_ids(tok, min(len(tok), engine.config.model.vocab_size)), tok)
    app = build_app(engine, kv_inspector=True)
    inspector = app.state.kv_inspector
    spent = [0.0]
    capture = inspector.capture

    def timed_capture(e: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return capture(e)
        finally:
            spent[0] += time.perf_counter() - t0

    inspector.capture = timed_capture
    server, thread, base = _serve(app)
    try:
        run_serve(base, reqs[:8])  # warm-up, untimed
        rows: dict[str, list[dict[str, float]]] = {"unwatched": [], "watched": []}
        for rep in range(args.reps):
            for mode in (("unwatched", "watched") if rep % 2 == 0 else ("watched", "unwatched")):
                stop, seen = threading.Event(), []
                viewer = threading.Thread(target=_viewer, args=(base, stop, seen), daemon=True)
                spent[0], captures0 = 0.0, inspector.num_captures
                if mode == "watched":
                    viewer.start()
                res = run_serve(base, reqs)
                stop.set()
                if mode == "watched":
                    viewer.join(30)
                assert res["failed"] == 0, res["errors"]
                n = inspector.num_captures - captures0
                rows[mode].append({"tok_s": res["output_throughput"], "dur": res["duration_s"],
                                   "captures": n, "capture_ms": 1e3 * spent[0] / max(n, 1),
                                   "engine_frac": spent[0] / res["duration_s"],
                                   "messages": len(seen)})
                r = rows[mode][-1]
                print(f"rep {rep} {mode:9s} {r['tok_s']:8.1f} output tok/s  {r['dur']:6.2f} s  "
                      f"{n:3d} snapshots ({r['capture_ms']:.2f} ms each, "
                      f"{100 * r['engine_frac']:.2f} % of the run)  {len(seen)} messages read",
                      flush=True)
    finally:
        server.should_exit = True
        thread.join(30)
    ratios = [w["tok_s"] / u["tok_s"] for w, u in zip(rows["watched"], rows["unwatched"])]
    print(f"watched / unwatched output tok/s per rep: {' '.join(f'{x:.3f}' for x in ratios)}; "
          f"median {statistics.median(ratios):.3f}")
    frac = statistics.median(r["engine_frac"] for r in rows["watched"])
    print(f"engine thread taking snapshots: median {100 * frac:.2f} % of a watched run")


if __name__ == "__main__":
    main()
