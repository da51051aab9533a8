"""``bench serve``: online latency and throughput of a running ``pagedllm serve`` (or any
OpenAI-compatible server) over HTTP.

Requests go to ``POST /v1/completions`` with ``stream: true``; the time of every streamed chunk
is recorded. Arrivals are a Poisson process at ``request_rate`` requests/s (``inf``: all at once),
optionally capped at ``max_concurrency`` requests in flight. Per request:

    TTFT  first chunk - send time
    ITL   gaps between consecutive chunks
    TPOT  (E2E - TTFT) / (output tokens - 1)
    E2E   last chunk - send time

Reported: mean/p50/p90/p99 of each (ms), request/output/total token throughput, and goodput:
requests/s that met every given SLO (``slo_ttft_ms``, ``slo_tpot_ms``, ``slo_e2e_ms``).
Output tokens are the server's ``usage.completion_tokens`` when it sends usage, else the number
of non-empty chunks.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedllm.bench.report import format_table, machine_info, percentiles, plot, write_json
from pagedllm.bench.workload import BenchRequest, poisson_arrivals, summarize

METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


@dataclass
class RequestTiming:
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


async def _one(client: Any, url: str, payload: dict[str, Any], prompt_len: int) -> RequestTiming:
    rec = RequestTiming(prompt_tokens=prompt_len)
    t0 = time.perf_counter()
    last = t0
    chunks = 0
    usage_tokens: int | None = None
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {body[:200]}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                usage = msg.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
                choices = msg.get("choices") or []
                if not choices or not (choices[0].get("text") or choices[0].get("token_ids")):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    rec.ttft = now - t0
                else:
                    rec.itls.append(now - last)
                last = now
                chunks += 1
        rec.e2e = last - t0
        rec.output_tokens = usage_tokens if usage_tokens is not None else chunks
        rec.ok = chunks > 0
        if not rec.ok:
            rec.error = "the stream carried no tokens"
    except Exception as e:  # noqa: BLE001 - a failed request is a data point, not a crash
        rec.error = f"{type(e).__name__}: {e}"
    return rec


async def _run(base_url: str, model: str, reqs: list[BenchRequest], arrivals: list[float],
               max_concurrency: int | None, prompt_format: str, timeout_s: float,
               tokenizer: Any) -> tuple[list[RequestTiming], float]:
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=max_concurrency or len(reqs) or 1)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter()

        async def fire(r: BenchRequest, at: float) -> RequestTiming:
            delay = at - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            if prompt_format == "text":
                prompt: Any = r.prompt if r.prompt is not None else tokenizer.decode(r.prompt_token_ids)
            else:
                prompt = r.prompt_token_ids
            payload = {"model": model, "prompt": prompt, "max_tokens": r.max_tokens,
                       "temperature": 0.0, "stream": True, "ignore_eos": True,
                       "stream_options": {"include_usage": True}}
            if sem is None:
                return await _one(client, url, payload, r.prompt_len)
            async with sem:
                return await _one(client, url, payload, r.prompt_len)

        timings = await asyncio.gather(*(fire(r, a) for r, a in zip(reqs, arrivals)))
        return list(timings), time.perf_counter() - start


def served_model(base_url: str, timeout_s: float = 10.0) -> str:
    """The first model id the server lists at ``/v1/models``."""
    import httpx

    try:
        r = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=timeout_s)
        r.raise_for_status()
    except httpx.HTTPError as e:
        raise ValueError(f"cannot list models at {base_url}/v1/models ({type(e).__name__}: {e}); "
                         f"start `pagedllm serve` first, or fix --base-url") from e
    data = r.json().get("data") or []
    if not data:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --served-model-name")
    return str(data[0]["id"])


def run_serve(
    base_url: str,
    reqs: list[BenchRequest],
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    model: str | None = None,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    slo_e2e_ms: float | None = None,
    prompt_format: str = "ids",
    seed: int = 0,
    timeout_s: float = 600.0,
    tokenizer: Any = None,
    use_trace_arrivals: bool = False,
) -> dict[str, Any]:
    try:
        import httpx  # noqa: F401
    except ImportError as e:
        raise ValueError("bench serve needs httpx; pip install 'pagedllm[dev]' or httpx") from e
    model = model or served_model(base_url)
    if use_trace_arrivals and all(r.arrival_time is not None for r in reqs):
        arrivals = [float(r.arrival_time) for r in reqs]  # type: ignore[arg-type]
    else:
        arrivals = poisson_arrivals(len(reqs), request_rate, seed)
    timings, duration = asyncio.run(_run(base_url, model, reqs, arrivals, max_concurrency,
                                         prompt_format, timeout_s, tokenizer))
    ok = [t for t in timings if t.ok]
    ms = 1e3
    metrics = {
        "ttft_ms": percentiles([t.ttft * ms for t in ok]),
        "tpot_ms": percentiles([t.tpot * ms for t in ok if t.tpot is not None]),
        "itl_ms": percentiles([x * ms for t in ok for x in t.itls]),
        "e2e_ms": percentiles([t.e2e * ms for t in ok]),
    }

    def meets(t: RequestTiming) -> bool:
        return ((slo_ttft_ms is None or t.ttft * ms <= slo_ttft_ms)
                and (slo_tpot_ms is None or (t.tpot or 0.0) * ms <= slo_tpot_ms)
                and (slo_e2e_ms is None or t.e2e * ms <= slo_e2e_ms))

    good = sum(1 for t in ok if meets(t))
    out_tok = sum(t.output_tokens for t in ok)
    in_tok = sum(t.prompt_tokens for t in ok)
    errors = [t.error for t in timings if not t.ok]
    return {
        "benchmark": "serve",
        "base_url": base_url,
        "model": model,
        "request_rate": "inf" if math.isinf(request_rate) else request_rate,
        "max_concurrency": max_concurrency,
        "completed": len(ok),
        "failed": len(timings) - len(ok),
        "errors": errors[:10],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tok / duration,
        "total_token_throughput": (in_tok + out_tok) / duration,
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms, "e2e_ms": slo_e2e_ms},
        "goodput": good / duration,
        "good_requests": good,
        **metrics,
        "per_request": [{"ok": t.ok, "prompt_tokens": t.prompt_tokens,
                         "output_tokens": t.output_tokens, "ttft_ms": t.ttft * ms,
                         "tpot_ms": None if t.tpot is None else t.tpot * ms,
                         "e2e_ms": t.e2e * ms} for t in timings],
        "workload": summarize(reqs),
        "machine": machine_info(),
    }


def report_serve(res: dict[str, Any], output_dir: Path, output_json: Path | None,
                 make_plots: bool = True) -> list[Path]:
    print(f"{res['completed']} completed, {res['failed']} failed in {res['duration_s']:.2f}s "
          f"(rate {res['request_rate']} req/s, max concurrency {res['max_concurrency']})")
    if res["errors"]:
        print(f"first error: {res['errors'][0]}")
    print(f"request throughput {res['request_throughput']:.3f} req/s, output "
          f"{res['output_throughput']:.1f} tok/s, total {res['total_token_throughput']:.1f} tok/s, "
          f"goodput {res['goodput']:.3f} req/s ({res['good_requests']} within SLO {res['slo']})")
    rows = [{"metric": m, **res[m]} for m in METRICS]
    print(format_table(rows, ("metric", "mean", "p50", "p90", "p99")))
    paths = [write_json(output_json or output_dir / "serve.json", res)]
    if make_plots:
        per = [r for r in res["per_request"] if r["ok"]]

        def draw(plt: Any) -> None:
            plt.hist([r["ttft_ms"] for r in per], bins=30, alpha=0.6, label="TTFT")
            plt.hist([r["e2e_ms"] for r in per], bins=30, alpha=0.6, label="E2E")
            plt.xlabel("ms")
            plt.ylabel("requests")
            plt.legend()
            plt.title(f"serve latency, rate {res['request_rate']} req/s")

        p = plot(output_dir / "serve.png", draw)
        if p:
            paths.append(p)
    return paths


def run_serve_backends(a: Any, model: str, reqs: list[BenchRequest], tokenizer: Any,
                       workload: dict[str, Any]) -> list[Path]:
    """``bench serve --backends``: each server started, driven by ``run_serve`` with the same
    requests and arrivals, stopped (``serve_backends``); a side-by-side table and JSON. With
    ``--policies`` / ``--serve-args``: the pagedllm server once per flag set (``serve_sets``)."""
    from pagedllm.bench.serve_backends import format_backends, run_backends, settings_from
    from pagedllm.bench.serve_sets import format_sets, run_sets, serve_sets

    def drive(base_url: str) -> dict[str, Any]:
        return run_serve(base_url, reqs, a.request_rate, a.max_concurrency, None, a.slo_ttft_ms,
                         a.slo_tpot_ms, a.slo_e2e_ms, a.prompt_format, a.seed, a.timeout,
                         tokenizer, a.use_trace_arrivals)

    if a.policies or a.serve_args:
        if a.backends:
            raise ValueError("--backends and --policies / --serve-args: pick one comparison")
        res = run_sets(serve_sets(a), settings_from(a, model), a.rounds, drive, a.start_timeout)
        name, show = "serve_sets.json", format_sets
    else:
        backends = [b.strip() for b in a.backends.split(",") if b.strip()]
        res = run_backends(backends, settings_from(a, model), a.rounds, drive, a.vllm_python,
                           a.start_timeout)
        name, show = "serve_backends.json", format_backends
    res["workload"] = workload
    res["request_rate"] = "inf" if math.isinf(a.request_rate) else a.request_rate
    res["machine"] = machine_info()
    print(show(res))
    return [write_json(a.output_json or a.output_dir / name, res)]


COMMAND = "serve"
HELP = "online latency against a running `pagedllm serve` (HTTP)"


def add_cli_args(p: Any) -> None:
    """``bench serve``'s flags: its own, the workload's, the output's, and the engine's
    --model / --tokenizer (the prompts' tokenizer), --max-model-len (caps prompt + output) and
    --seed."""
    from pagedllm.args import EngineArgs
    from pagedllm.bench.command import add_output_args
    from pagedllm.bench.serve_backends import add_backend_args
    from pagedllm.bench.serve_sets import add_set_args
    from pagedllm.bench.workload import WorkloadSpec

    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrivals, requests/s (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--served-model-name", default=None, help="default: the first of /v1/models")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--slo-e2e-ms", type=float, default=None)
    p.add_argument("--prompt-format", choices=["ids", "text"], default="ids",
                   help="send prompts as token id lists (default) or decoded text")
    p.add_argument("--use-trace-arrivals", action="store_true",
                   help="--workload trace: use the trace's arrival_time instead of Poisson")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, s")
    EngineArgs.add_cli_args(p, only=("model", "tokenizer", "max_model_len", "seed"))
    add_backend_args(p)
    add_set_args(p)
    WorkloadSpec.add_cli_args(p, 64)
    add_output_args(p)


def run(a: Any) -> int:
    from pagedllm.bench.command import prepare, show
    from pagedllm.bench.workload import WorkloadSpec, make_workload, vocab_ids
    from pagedllm.config import ModelConfig, default_model_path
    from pagedllm.tokenizer import get_tokenizer

    prepare(a)
    model = a.model or default_model_path()
    mcfg = ModelConfig.from_hf(model)
    tok = get_tokenizer(a.tokenizer or model)
    spec = WorkloadSpec(**{**WorkloadSpec.cli_kwargs(a),
                           "max_model_len": a.max_model_len or mcfg.max_position_embeddings})
    reqs = make_workload(spec, vocab_ids(tok, min(len(tok), mcfg.vocab_size)), tok)
    if a.backends or a.policies or a.serve_args:
        return show(run_serve_backends(a, model, reqs, tok, spec.describe()))
    res = run_serve(a.base_url, reqs, a.request_rate, a.max_concurrency, a.served_model_name,
                    a.slo_ttft_ms, a.slo_tpot_ms, a.slo_e2e_ms, a.prompt_format, a.seed,
                    a.timeout, tok, a.use_trace_arrivals)
    res["workload"] = {**spec.describe(), **res["workload"]}
    return show(report_serve(res, a.output_dir, a.output_json, a.plot))
