"""What a user reads at start-up and while serving: one INFO line naming the model, dtype, device
and KV pool (the OpenMP / huge pages / malloc choices at DEBUG), the CPU kernel build's start,
progress and "done in X s", and ``serve``'s stats line every interval (``--disable-log-stats``:
none)."""

from __future__ import annotations

import io
import logging
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from serve_process import REPO

from pagedllm import _openmp
from pagedllm.bench.server_process import serve_subprocess
from pagedllm.sched.stats import KVBlockCounts, StepStats
from pagedllm.server.stats_log import StatsLogger

TUNING = ("OpenMP", "huge pages", "malloc")


@contextmanager
def pagedllm_log(level: int) -> Iterator[list[tuple[int, str]]]:
    """(level, message) of every ``pagedllm`` record at ``level`` or above meanwhile."""
    root = logging.getLogger("pagedllm")
    old = root.level
    root.setLevel(level)
    records: list[tuple[int, str]] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append((record.levelno, record.getMessage()))

    handler = Keep()
    root.addHandler(handler)
    try:
        yield records
    finally:
        root.removeHandler(handler)
        root.setLevel(old)


def test_startup_says_model_dtype_device_and_pool_in_one_info_line(tiny_models: dict[str, Path]
                                                                    ) -> None:
    from pagedllm.engine import LLMEngine

    with pagedllm_log(logging.DEBUG) as records:
        LLMEngine.from_args(model=str(tiny_models["llama"]), block_size=4, num_kv_blocks=32,
                            max_model_len=64).shutdown()
    # torch imported before pagedllm (as here, under pytest): pagedllm could not choose the
    # OpenMP wait policy, and says at INFO what the user can do
    advice = _openmp.advice(torch.get_num_threads()) if _openmp.CHOICE is None else None
    info = [m for lvl, m in records if lvl >= logging.INFO and m != advice]
    assert len(info) == 1, info
    assert re.fullmatch(
        rf"model {re.escape(str(tiny_models['llama']))} \(LlamaForCausalLM\), dtype float32, "
        r"device cpu \((CPU kernels avx512|CPU kernels avx2|CPU kernels generic|pure torch)\); "
        r"KV cache: 32 blocks x 4 tokens = 128 tokens \(.* MiB, float32, \d+ bytes/token\); "
        r"fits 2 requests of max_model_len=64", info[0]), info[0]
    debug = [m for lvl, m in records if lvl == logging.DEBUG]
    chose_openmp = _openmp.CHOICE is not None and torch.get_num_threads() > 1
    for word in TUNING if chose_openmp else TUNING[1:]:
        assert any(word in m for m in debug), (word, debug)


def test_kernel_build_logs_start_progress_and_done(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The build's commands replaced by sleeps that end in reverse order (a real build takes a
    minute or more: the slow test_fresh_cache_compiles_once); the log lines are the build's."""
    from pagedllm import kernels

    n = len(kernels.SOURCES)

    def commands(out: Path) -> tuple[list[list[str]], list[str]]:  # the last source first
        return [["sleep", f"{0.25 * (n - i):.2f}"] for i in range(n)], ["touch", str(out)]

    monkeypatch.setattr(kernels, "_commands", commands)
    lib = tmp_path / "kernels" / "key" / "pagedllm_kernels.so"
    with pagedllm_log(logging.INFO) as records:
        kernels._build(lib)
    lines = [m for _, m in records]
    assert lib.exists() and len(lines) == n + 2, lines
    assert lines[0].startswith(f"compiling pagedllm CPU kernels ({n} sources")
    # each source as it finishes (they compile in parallel)
    assert [re.sub(r" \(\d+ s\)$", "", m) for m in lines[1:-1]] == [
        f"compiling pagedllm CPU kernels: {i}/{n} {src}"
        for i, src in enumerate(reversed(kernels.SOURCES), 1)]
    assert re.fullmatch(r"compiled pagedllm CPU kernels: done in \d+\.\d s", lines[-1])


def _client(stats: StepStats) -> SimpleNamespace:
    return SimpleNamespace(stats=stats, stats_listeners=[])


def test_stats_line_is_the_interval_s_throughput_queues_and_kv() -> None:
    now = [100.0]
    idle = StepStats(kv=KVBlockCounts(total=64, free=64))
    client = _client(idle)
    log = StatsLogger(client, interval=10.0, clock=lambda: now[0])  # type: ignore[arg-type]
    assert client.stats_listeners == [log.on_step]
    for prompt, gen in ((300, 20), (0, 30)):  # two steps' records, as the client gets them
        log.on_step(StepStats(num_prompt_tokens=prompt, num_generation_tokens=gen))
    client.stats = StepStats(num_running=3, num_waiting=2, kv=KVBlockCounts(total=64, free=48),
                             prefix_cache_queries=400, prefix_cache_hits=100)
    now[0] += 10.0
    assert log.line() == ("engine: prompt 30.0 tok/s, generation 5.0 tok/s; running 3, waiting "
                          "2, swapped 0 reqs; KV cache usage 25.0% (16/64 blocks); prefix cache "
                          "hit rate 25.0%")
    client.stats = StepStats(kv=KVBlockCounts(total=64, free=64), prefix_cache_queries=400,
                             prefix_cache_hits=100)
    now[0] += 5.0
    first_idle = log.line()  # an interval with nothing: said once, then silence
    assert first_idle is not None and first_idle.startswith("engine: prompt 0.0 tok/s, generation 0.0")
    assert "hit rate 0.0%" in first_idle and "usage 0.0%" in first_idle
    now[0] += 10.0
    assert log.line() is None
    log.on_step(StepStats(num_prompt_tokens=0, num_generation_tokens=4))
    now[0] += 2.0
    assert "generation 2.0 tok/s" in (log.line() or "")


@pytest.mark.parametrize("disable", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_serve_logs_startup_and_stats(tiny_models: dict[str, Path], disable: bool) -> None:
    """The real ``pagedllm serve`` at INFO (its stats every 0.3 s here): the start-up line once,
    no tuning line, and a stats line counting the request's tokens (none with
    --disable-log-stats)."""
    out = io.StringIO()
    env = {**os.environ, "PYTHONPATH": str(REPO), "PAGEDLLM_LOG_LEVEL": "INFO",
           "PAGEDLLM_LOG_STATS_INTERVAL": "0.3"}
    flags = [str(tiny_models["llama"]), "--block-size", "4", "--num-kv-blocks", "64",
             "--max-model-len", "64", *(["--disable-log-stats"] if disable else [])]
    with serve_subprocess(flags, log=out, env=env, timeout=180) as (_, base):
        r = httpx.post(base + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 8,
                                                       "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + (3 if disable else 30)
        while time.monotonic() < deadline and not _busy(out.getvalue()):
            time.sleep(0.1)
    log = out.getvalue()
    assert log.count("pagedllm.engine.engine_core: model ") == 1, log
    assert not [line for line in log.splitlines()
                if line.startswith("INFO") and any(w in line for w in TUNING)], log
    if disable:
        assert "engine: prompt" not in log and "--disable-log-stats has no effect" not in log
    else:
        assert _busy(log), log


def _busy(log: str) -> bool:
    """A stats line with prompt and generation throughput above zero."""
    found = re.findall(r"engine: prompt ([\d.]+) tok/s, generation ([\d.]+) tok/s", log)
    return any(float(p) > 0 and float(g) > 0 for p, g in found)

