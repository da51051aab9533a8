"""vLLM as a ``bench throughput`` backend, run in a Python of its own (``--vllm-python``).

vLLM pins its own torch and transformers, so it is installed in a separate virtual environment
(README "Performance" says how) and driven through ``vllm_worker.py``, a script that process
runs; see that file for the protocol. The backend hands vLLM the same model directory, the
dtype and ``max_model_len`` the engine resolves, the workload's prompt token ids, greedy
sampling with ``ignore_eos``; everything else stays at vLLM's defaults unless
``--vllm-kwargs`` names it. Model load and compilation happen once, before any timed run.

Threads and KV memory on CPU are vLLM environment variables, set here unless the caller's
environment already has them: ``VLLM_CPU_OMP_THREADS_BIND`` to as many cores as pagedllm's
torch uses (``--threads``, else torch's default), ``VLLM_CPU_KVCACHE_SPACE`` to
``--kv-cache-memory`` in whole GiB, rounded up (vLLM takes no fraction; 4 when not given: vLLM's own default, a fraction of all memory,
refuses to start on a machine other processes use). The OpenMP wait policy and the huge pages
pagedllm picks for itself (pagedllm/_openmp.py, _hugepages.py) are not passed on: vLLM sees
the user's environment. vLLM's log goes
to a file named in the result.

The worker runs in a session of its own, and vLLM's engine processes (its children) in its
process group: ``close()`` (run_throughput calls it; garbage collection and interpreter exit
too) kills the whole group after the worker exits, at once when a call was in flight (an
interrupt); a benchmark killed outright takes the group down from the worker's side
(vllm_worker.py). A leftover ``VLLM::EngineCore`` holds gigabytes.

A run returns only once vLLM's processes are idle (``wait_until_idle``). After each message
vLLM's worker keeps polling its shared-memory queue for a second (``sched_yield`` in a loop:
``shm_broadcast.SpinCondition``, ``busy_loop_s=1``), a whole core; the backend timed next would
share the machine with it. On the 5M model a pagedllm run takes ~1 s, so this halved the
machine for most of it. ``bench throughput`` reports what other processes used during each run
(``machine_cpu_s`` minus ``cpu_s``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from pagedllm import _hugepages, _openmp, envs
from pagedllm.bench.baselines import RunResult
from pagedllm.bench.workload import BenchRequest

WORKER = Path(__file__).with_name("vllm_worker.py")
IDLE_WINDOW_S = 0.2  # idle: the group used at most IDLE_CORES of a core over this window
IDLE_CORES = 0.1
IDLE_LIMIT_S = 10.0  # give up waiting (a busy machine, a vLLM that never settles) after this


def find_vllm_python(explicit: str | None = None) -> str | None:
    """``explicit``, else ``$PAGEDLLM_VLLM_PYTHON``, else this Python when it can import vllm."""
    import importlib.util

    found = explicit or envs.get("PAGEDLLM_VLLM_PYTHON")
    if found:
        return found
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


def cpu_bind(num_threads: int, cpus: Sequence[int] | None = None) -> str:
    """The first ``num_threads`` CPUs this process may run on, as vLLM's bind list ('0-1,4')."""
    ids = sorted(cpus if cpus is not None else os.sched_getaffinity(0))[:num_threads]
    parts: list[str] = []
    start = prev = ids[0]
    for c in [*ids[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ",".join(parts)


def make_vllm_backend(engine_kwargs: dict[str, Any], python: str | None,
                      llm_kwargs: dict[str, Any] | None = None) -> VllmBackend:
    found = find_vllm_python(python)
    if found is None:
        raise ValueError("backend 'vllm' needs a Python with vllm installed: pass --vllm-python "
                         "PATH (or set PAGEDLLM_VLLM_PYTHON); docs/performance/serving.md says "
                         "how to make that venv")
    return VllmBackend(engine_kwargs, found, llm_kwargs)


class VllmBackend:
    def __init__(self, engine_kwargs: dict[str, Any], python: str,
                 llm_kwargs: dict[str, Any] | None = None) -> None:
        import torch

        from pagedllm.bench.workload import engine_config

        cfg = engine_config(engine_kwargs)
        self.name = "vllm"
        kwargs = {"dtype": cfg.model.dtype, "max_model_len": cfg.scheduler.max_model_len,
                  "seed": cfg.seed, **(llm_kwargs or {})}
        env = dict(os.environ)
        for var in (_openmp.SET_BY_PAGEDLLM, _hugepages.SET_BY_PAGEDLLM):
            if var:  # vLLM runs at the user's OpenMP and huge-page settings, not pagedllm's
                env.pop(var, None)
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_bind(torch.get_num_threads()))
        kv = cfg.cache.kv_cache_memory
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(4 if kv is None else -(-kv // 2**30)))
        self.log = Path(tempfile.mkstemp(prefix="pagedllm-vllm-", suffix=".log")[1])
        self._log_file = self.log.open("w")
        try:  # a session of its own: its group (vLLM's engine processes too) is killed as one
            self.proc = subprocess.Popen(
                [python, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=self._log_file, env=env, text=True, start_new_session=True,
            )
        except OSError as e:
            self._log_file.close()
            raise ValueError(f"--vllm-python {python}: cannot run it ({e.strerror}); name the "
                             f"python of a venv with vllm installed") from e
        self._busy = [False]  # a call in flight: the worker would not read "exit" until done
        self.close = weakref.finalize(self, _stop, self.proc, self._log_file, self._busy)
        try:
            self.info: dict[str, Any] = self._call({"cmd": "init", "model": cfg.model.model,
                                                    "llm_kwargs": kwargs})["info"]
        except BaseException:
            self.close()
            raise

    def run(self, reqs: list[BenchRequest]) -> RunResult:
        res = self._call({"cmd": "run",
                          "requests": [[r.prompt_token_ids, r.max_tokens] for r in reqs]})
        idle_s = wait_until_idle(self.proc.pid)
        outs: list[list[int]] = res["outputs"]
        n = sum(len(o) for o in outs)
        cpu: dict[str, float] = {k: res[k] for k in ("cpu_s", "machine_cpu_s") if k in res}
        return RunResult(self.name, res["elapsed_s"], len(reqs), sum(r.prompt_len for r in reqs),
                         n, n, outs, {**self.info, "log": str(self.log), **cpu,
                                      "idle_wait_s": idle_s})

    def _call(self, msg: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._busy[0] = True
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        self._busy[0] = False  # not reached on an interrupt: the stop then kills at once
        if not line:
            raise RuntimeError(f"the vLLM process (--vllm-python) exited during {msg['cmd']!r}; "
                               f"its log {self.log} ends with:\n{_tail(self.log)}")
        reply: dict[str, Any] = json.loads(line)
        if not reply.get("ok"):
            raise RuntimeError(f"vLLM failed during {msg['cmd']!r} (log: {self.log}):\n"
                               f"{reply.get('error')}")
        return reply


def group_cpu_s(pgid: int) -> float | None:
    """CPU seconds (user + system, all threads) of the live processes of process group ``pgid``;
    None when it has none."""
    import psutil

    found = None
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid:
                t = p.cpu_times()
                found = (found or 0.0) + t.user + t.system
        except (ProcessLookupError, psutil.Error):  # exited meanwhile
            continue
    return found


def wait_until_idle(pgid: int, window_s: float = IDLE_WINDOW_S,
                    limit_s: float = IDLE_LIMIT_S) -> float:
    """Wait until process group ``pgid`` used at most ``IDLE_CORES`` of a core over a whole
    ``window_s``, at most ``limit_s``; returns the seconds waited."""
    t0 = time.perf_counter()
    prev = group_cpu_s(pgid)
    while prev is not None and time.perf_counter() - t0 < limit_s:
        time.sleep(window_s)
        cur = group_cpu_s(pgid)
        if cur is None or cur - prev <= IDLE_CORES * window_s:
            break
        prev = cur
    return time.perf_counter() - t0


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _stop(proc: subprocess.Popen[str], log_file: IO[str], busy: list[bool]) -> None:
    """Ask an idle worker to exit, kill a busy or stuck one; then kill what is left of its
    process group (vLLM's engine core outlives a worker that exits without its teardown)."""
    if proc.poll() is None and not busy[0]:
        try:
            assert proc.stdin is not None
            proc.stdin.write('{"cmd": "exit"}\n')
            proc.stdin.close()
            proc.wait(timeout=30)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group lives on while any member does
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    log_file.close()
