"""``bench serve --backends pagedllm,vllm``: start each server, drive it with the same client and
workload, stop it; rounds alternate the order, so a machine that slows down mid-run weighs on
both backends alike.

Both servers get the same model directory, dtype, ``max_model_len``, ``max_num_seqs``, KV
memory and cores:

    pagedllm   python -m pagedllm.entrypoints.cli serve --kv-cache-memory M ...
    vllm       PY -m vllm.entrypoints.openai.api_server ...   VLLM_CPU_KVCACHE_SPACE = M in GiB,
                                                              VLLM_CPU_OMP_THREADS_BIND = the
                                                              cores this process may use

Each server runs in a session of its own; its whole process group (pagedllm's engine core,
vLLM's EngineCore) is killed when its turn ends, so nothing is left behind.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedllm import _hugepages, _openmp
from pagedllm.bench.vllm_backend import cpu_bind, find_vllm_python

BACKENDS = ("pagedllm", "vllm")


@dataclass(frozen=True)
class ServerSettings:
    """What both servers are given. ``kv_cache_memory`` in bytes; ``threads`` cores."""

    model: str
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    kv_cache_memory: int = 4 * 2**30
    threads: int | None = None
    extra: tuple[str, ...] = ()  # more flags for pagedllm serve
    vllm_extra: tuple[str, ...] = ()  # more flags for vLLM's server


def server_command(backend: str, s: ServerSettings, port: int,
                   vllm_python: str | None = None) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that start ``backend``'s OpenAI server on 127.0.0.1:``port``."""
    env = dict(os.environ)
    common = ["--model", s.model, "--host", "127.0.0.1", "--port", str(port), "--dtype", s.dtype,
              "--max-num-seqs", str(s.max_num_seqs)]
    if s.max_model_len is not None:
        common += ["--max-model-len", str(s.max_model_len)]
    if backend == "pagedllm":
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *common,
               "--kv-cache-memory", str(s.kv_cache_memory), *s.extra]
        if s.threads is not None:
            env["OMP_NUM_THREADS"] = str(s.threads)
        return cmd, env
    if backend == "vllm":
        py = find_vllm_python(vllm_python)
        if py is None:
            raise ValueError("backend 'vllm' needs a Python with vllm installed: pass "
                             "--vllm-python PATH (or set PAGEDLLM_VLLM_PYTHON)")
        for var in (_openmp.SET_BY_PAGEDLLM, _hugepages.SET_BY_PAGEDLLM):
            if var:  # vLLM runs at the user's OpenMP and huge-page settings, not pagedllm's
                env.pop(var, None)
        if s.threads is not None:  # else vLLM's default: every core but one, bound
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_bind(s.threads))
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, -(-s.kv_cache_memory // 2**30))))
        cmd = [py, "-m", "vllm.entrypoints.openai.api_server", *common,
               "--uvicorn-log-level", "warning", *s.vllm_extra]
        return cmd, env
    raise ValueError(f"unknown serve backend {backend!r}; choose from {', '.join(BACKENDS)}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def running_server(cmd: list[str], env: dict[str, str], port: int,
                   timeout_s: float = 900.0) -> Iterator[str]:
    """Start ``cmd`` in its own session, yield its base URL once ``/health`` is 200; kill its
    process group on exit. The server's output goes to a temporary log, quoted on failure."""
    import httpx

    log = Path(tempfile.mkstemp(prefix="pagedllm-bench-serve-", suffix=".log")[1])
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{shlex.join(cmd)} exited with {proc.returncode} at "
                                   f"start-up:\n{_tail(log)}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{shlex.join(cmd)} did not come up within {timeout_s:.0f} s:"
                                   f"\n{_tail(log)}")
            time.sleep(0.5)
        yield base
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # what is left of the group (engine cores)
        proc.wait()
        log.unlink(missing_ok=True)


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def run_backends(backends: list[str], settings: ServerSettings, rounds: int,
                 drive: Callable[[str], dict[str, Any]], vllm_python: str | None = None,
                 start_timeout_s: float = 900.0) -> dict[str, Any]:
    """Each round starts, drives (``drive(base_url)`` -> ``run_serve``'s result) and stops every
    backend in turn; odd rounds reverse the order. Returns the runs and a per-backend summary
    (medians over rounds) with ratios to the last backend (pagedllm / vllm)."""
    for b in backends:
        server_command(b, settings, 0, vllm_python)  # an unknown backend fails before any start
    runs: dict[str, list[dict[str, Any]]] = {b: [] for b in backends}
    for r in range(rounds):
        for b in backends if r % 2 == 0 else backends[::-1]:
            port = free_port()
            cmd, env = server_command(b, settings, port, vllm_python)
            print(f"round {r + 1}/{rounds}: {b} ({shlex.join(cmd[:6])} ...)", flush=True)
            with running_server(cmd, env, port, start_timeout_s) as base:
                res = drive(base)
            res.pop("per_request", None)
            runs[b].append(res)
            print(f"  {b}: {res['completed']} ok, {res['failed']} failed, "
                  f"{res['output_throughput']:.1f} out tok/s, TPOT mean "
                  f"{res['tpot_ms'].get('mean', math.nan):.1f} ms", flush=True)
    summary = {b: summarize_runs(rs) for b, rs in runs.items()}
    ref = backends[-1]
    for b in backends:
        s, base_s = summary[b], summary[ref]
        s["output_throughput_ratio"] = _ratio(s["output_throughput"], base_s["output_throughput"])
        s["tpot_mean_ratio"] = _ratio(s["tpot_mean_ms"], base_s["tpot_mean_ms"])
        s["ttft_mean_ratio"] = _ratio(s["ttft_mean_ms"], base_s["ttft_mean_ms"])
    return {"benchmark": "serve-backends", "backends": backends, "rounds": rounds,
            "reference": ref, "settings": {k: v for k, v in vars(settings).items()},
            "summary": summary, "runs": runs}


def summarize_runs(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds of ``run_serve`` results: throughput, TTFT, TPOT, E2E; failures summed."""
    def med(f: Callable[[dict[str, Any]], float]) -> float:
        vals = [f(r) for r in rs if not math.isnan(f(r))]
        return statistics.median(vals) if vals else math.nan

    return {
        "output_throughput": med(lambda r: r["output_throughput"]),
        "request_throughput": med(lambda r: r["request_throughput"]),
        "ttft_mean_ms": med(lambda r: r["ttft_ms"].get("mean", math.nan)),
        "tpot_mean_ms": med(lambda r: r["tpot_ms"].get("mean", math.nan)),
        "tpot_p50_ms": med(lambda r: r["tpot_ms"].get("p50", math.nan)),
        "e2e_mean_ms": med(lambda r: r["e2e_ms"].get("mean", math.nan)),
        "failed": sum(r["failed"] for r in rs),
        "per_round_output_throughput": [r["output_throughput"] for r in rs],
    }


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def format_backends(res: dict[str, Any]) -> str:
    from pagedllm.bench.report import format_table

    ref = res["reference"]
    rows = [{"backend": b, "out tok/s": f"{s['output_throughput']:.1f}",
             f"x {ref}": f"{s['output_throughput_ratio']:.2f}",
             "TTFT ms": f"{s['ttft_mean_ms']:.1f}", "TPOT ms": f"{s['tpot_mean_ms']:.1f}",
             f"TPOT x {ref}": f"{s['tpot_mean_ratio']:.2f}", "failed": s["failed"]}
            for b, s in res["summary"].items()]
    return format_table(rows, tuple(rows[0]))


def add_backend_args(p: argparse.ArgumentParser) -> None:
    """``bench serve``'s flags for starting the servers itself."""
    g = p.add_argument_group("side by side (bench serve starts each server; --base-url unused)")
    g.add_argument("--backends", default=None,
                   help="comma-separated, from: pagedllm, vllm (e.g. 'pagedllm,vllm'); ratios "
                        "are to the last")
    g.add_argument("--vllm-python", default=None,
                   help="python of a venv with vLLM's CPU build (or $PAGEDLLM_VLLM_PYTHON)")
    g.add_argument("--rounds", type=int, default=1, help="rounds; odd rounds reverse the order")
    g.add_argument("--server-dtype", default="auto")
    g.add_argument("--server-max-num-seqs", type=int, default=256,
                   help="both servers' max_num_seqs (vLLM's CPU default: 256)")
    g.add_argument("--server-kv-cache-memory", default="4GiB",
                   help="KV memory of both (vLLM: VLLM_CPU_KVCACHE_SPACE in whole GiB)")
    g.add_argument("--server-threads", type=int, default=None,
                   help="cores for both (default: all this process may use)")
    g.add_argument("--pagedllm-args", default="", help="more `pagedllm serve` flags, one string")
    g.add_argument("--vllm-args", default="", help="more vLLM server flags, one string")
    g.add_argument("--start-timeout", type=float, default=900.0,
                   help="seconds a server may take to answer /health (vLLM compiles at start)")


def settings_from(a: argparse.Namespace, model: str) -> ServerSettings:
    from pagedllm.config import parse_memory

    if a.rounds < 1:
        raise ValueError(f"--rounds {a.rounds} must be >= 1")
    return ServerSettings(model=model, dtype=a.server_dtype, max_model_len=a.max_model_len,
                          max_num_seqs=a.server_max_num_seqs,
                          kv_cache_memory=parse_memory(a.server_kv_cache_memory),
                          threads=a.server_threads, extra=tuple(shlex.split(a.pagedllm_args)),
                          vllm_extra=tuple(shlex.split(a.vllm_args)))
