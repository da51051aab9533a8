"""The vLLM side of ``bench throughput --backends ...,vllm``: a script run by *another* Python.

vLLM pins its own torch and transformers, so it lives in its own virtual environment; the
benchmark starts ``<vllm-python> vllm_worker.py`` and talks to it over stdin/stdout, one JSON
object per line. This file therefore imports nothing from pagedllm (that venv need not have it),
and vLLM's own prints are sent to stderr so that stdout carries only the protocol:

    -> {"cmd": "init", "model": ..., "llm_kwargs": {...}}   <- {"ok": true, "info": {...}}
    -> {"cmd": "run", "requests": [[prompt_ids, max_tokens], ...]}
                                                          <- {"ok": true, "elapsed_s": s, "outputs": [[ids], ...]}
    -> {"cmd": "exit"}

A run is timed here, around ``LLM.generate`` alone (greedy, ``ignore_eos``, every request
submitted at once), so that neither the pipe nor JSON counts; model load and compilation happen
at ``init``, before any timed run, as the engine's load does on the pagedllm side.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any


def _serve(proto: Any) -> None:
    llm = None
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            if msg["cmd"] == "exit":
                break
            if msg["cmd"] == "init":
                llm, info = _init(msg["model"], msg.get("llm_kwargs") or {})
                reply: dict[str, Any] = {"ok": True, "info": info}
            elif msg["cmd"] == "run":
                assert llm is not None, "run before init"
                reply = {"ok": True, **_run(llm, msg["requests"])}
            else:
                reply = {"ok": False, "error": f"unknown command {msg['cmd']!r}"}
        except Exception:  # noqa: BLE001 - reported to the parent, which raises
            reply = {"ok": False, "error": traceback.format_exc()}
        proto.write(json.dumps(reply) + "\n")
        proto.flush()


def _init(model: str, llm_kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    import torch
    import vllm
    from vllm import LLM

    llm = LLM(model=model, **llm_kwargs)
    info = {
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "llm_kwargs": llm_kwargs,
        "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU_")
                or k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "THP_MEM_ALLOC_ENABLE")},
    }
    return llm, info


def _run(llm: Any, requests: list[list[Any]]) -> dict[str, Any]:
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": ids} for ids, _ in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in requests]
    llm.reset_prefix_cache()  # a repetition must not hit the previous one's blocks
    c0, m0 = _tree_cpu_s(), _machine_busy_s()
    t0 = time.perf_counter()
    res = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    c1, m1 = _tree_cpu_s(), _machine_busy_s()
    reply: dict[str, Any] = {"elapsed_s": elapsed,
                             "outputs": [list(r.outputs[0].token_ids) for r in res]}
    if c0 is not None and c1 is not None:
        reply["cpu_s"] = c1 - c0
    if m0 is not None and m1 is not None:
        reply["machine_cpu_s"] = m1 - m0
    return reply


def _machine_busy_s() -> float | None:
    """CPU seconds every process on the machine has spent busy (pagedllm/_openmp.py counts the
    same way; this file cannot import pagedllm, psutil comes with vLLM); None without psutil."""
    try:
        import psutil
    except ImportError:
        return None
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + sum(getattr(t, k, 0.0) for k in ("irq", "softirq", "steal"))


def _tree_cpu_s() -> float | None:
    """CPU seconds of this process and its live descendants (vLLM's engine core runs in a
    child); None without psutil."""
    try:
        import psutil
    except ImportError:
        return None
    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.Error:  # exited meanwhile
            continue
        total += t.user + t.system
    return total


def _die_with_parent() -> None:
    """Linux: SIGTERM this process when the benchmark dies, and on SIGTERM kill the whole process
    group (this worker leads it; vLLM's engine processes are in it), so no vLLM is left
    computing or holding memory."""
    import signal

    def kill_group(signum: int, frame: Any) -> None:
        os.killpg(os.getpgrp(), signal.SIGKILL)

    if os.getpgrp() == os.getpid():  # started as a group leader (the backend does that)
        signal.signal(signal.SIGTERM, kill_group)
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main() -> None:
    _die_with_parent()
    proto = os.fdopen(os.dup(1), "w")  # the protocol keeps the real stdout ...
    os.dup2(2, 1)  # ... and everything else printed (vLLM's logs, subprocesses) goes to stderr
    sys.stdout = sys.stderr
    _serve(proto)
    sys.stderr.flush()
    os._exit(0)  # vLLM's engine processes follow their parent; skip its slow teardown


if __name__ == "__main__":  # vLLM spawns engine processes, which re-import this module
    main()
