"""The vllm backend of ``bench throughput``: vLLM runs in a Python of its own, over a pipe.

The plumbing (protocol, settings handed over, timing, errors, shutdown) is tested against a
stand-in ``vllm`` package on this Python; the real comparison runs when a vLLM Python is named
by ``$PAGEDLLM_VLLM_PYTHON`` (README "Performance" says how to make one)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pagedllm.bench.throughput import run_throughput
from pagedllm.bench.vllm_backend import (
    VllmBackend,
    cpu_bind,
    group_cpu_s,
    make_vllm_backend,
    wait_until_idle,
)
from pagedllm.bench.workload import build_workload
from pagedllm.entrypoints.cli import main

STAND_IN = '''
import json, os
class SamplingParams:
    def __init__(self, **kw):
        self.kw = kw
class _Out:
    def __init__(self, ids):
        self.token_ids = ids
class _Res:
    def __init__(self, ids):
        self.outputs = [_Out(ids)]
class LLM:
    def __init__(self, model, **kw):
        if "broken" in model:
            raise ValueError("stand-in cannot load " + model)
        self.kw = kw
        print("stand-in vllm log line")  # must not reach the protocol stream
        if os.environ.get("STAND_IN_PIDS"):  # an engine-core-like child, as vLLM starts
            import subprocess, sys
            self.core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            with open(os.environ["STAND_IN_PIDS"], "w") as f:
                f.write(f"{os.getpid()} {self.core.pid}")
    def reset_prefix_cache(self):
        pass
    def generate(self, prompts, params, use_tqdm=True):
        if os.environ.get("STAND_IN_BLOCK"):  # a long run, to be interrupted
            open(os.environ["STAND_IN_BLOCK"], "w").close()
            import time; time.sleep(600)
        assert all(p.kw == {"temperature": 0.0, "max_tokens": p.kw["max_tokens"],
                            "ignore_eos": True} for p in params)
        if os.environ.get("STAND_IN_SPIN_S"):  # a process busy after the reply, as vLLM's
            import subprocess, sys                # worker polls its queue for a second
            subprocess.Popen([sys.executable, "-c", "import time\\nt = time.monotonic() + "
                              + os.environ["STAND_IN_SPIN_S"] + "\\nwhile time.monotonic() < t: pass"])
        return [_Res([sum(p["prompt_token_ids"]) % 97 + i for i in range(s.kw["max_tokens"])])
                for p, s in zip(prompts, params)]
__version__ = "0.0-stand-in"
'''


@pytest.fixture()
def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(textwrap.dedent(STAND_IN))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.delenv(k, raising=False)
    return sys.executable


def _kwargs(model: Path, **kw: object) -> dict:
    return dict(model=str(model), max_model_len=64, block_size=4, **kw)


@pytest.mark.slow
def test_stand_in_runs_the_workload_with_the_engine_settings(stand_in: str,
                                                              tiny_models: dict[str, Path]) -> None:
    kw = _kwargs(tiny_models["llama"], kv_cache_memory="512MiB")
    spec, reqs, _ = build_workload(kw, dict(num_prompts=5, prompt_median=8, output_median=6))
    res = run_throughput(reqs, spec, kw, ["pagedllm", "vllm"], reps=2, warmup=1,
                         vllm_python=stand_in, vllm_kwargs={"max_num_seqs": 4})
    row = {r["backend"]: r for r in res["results"]}["vllm"]
    assert row["output_tokens"] == sum(r.max_tokens for r in reqs)
    assert len(row["elapsed_s_all"]) == 2
    assert row["llm_kwargs"] == {"dtype": "float32", "max_model_len": 64, "seed": 0,
                                 "max_num_seqs": 4}
    assert row["env"]["VLLM_CPU_KVCACHE_SPACE"] == "1"  # whole GiB, rounded up
    assert row["env"]["VLLM_CPU_OMP_THREADS_BIND"] == cpu_bind(__import__("torch").get_num_threads())
    # what pagedllm chose for itself (OpenMP wait policy, huge pages) stays out of vLLM's run
    from pagedllm import _hugepages, _openmp
    for chosen in (_openmp.SET_BY_PAGEDLLM, _hugepages.VAR if _hugepages.SET_BY_PAGEDLLM else None):
        if chosen:
            assert chosen not in row["env"]
    assert "stand-in vllm log line" in Path(row["log"]).read_text()
    assert "pagedllm/vllm" in res["ratios"]
    assert 0.0 <= res["greedy_output_agreement"]["pagedllm/vllm"] <= 1.0


def test_errors_name_the_flag_and_show_vllms_message(stand_in: str, tmp_path: Path,
                                                     tiny_models: dict[str, Path],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    broken = tmp_path / "broken-model"
    broken.mkdir()
    for f in tiny_models["llama"].iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    with pytest.raises(RuntimeError, match="stand-in cannot load"):
        make_vllm_backend(_kwargs(broken), stand_in)
    with pytest.raises(ValueError, match="--vllm-python .*no-such-python"):
        VllmBackend(_kwargs(tiny_models["llama"]), str(tmp_path / "no-such-python"))
    quits = tmp_path / "quits"
    quits.write_text("#!/bin/sh\necho no vllm here >&2\n")
    quits.chmod(0o755)
    with pytest.raises(RuntimeError, match="exited during 'init'.*\n.*no vllm here"):
        VllmBackend(_kwargs(tiny_models["llama"]), str(quits))
    monkeypatch.delenv("PAGEDLLM_VLLM_PYTHON", raising=False)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ValueError, match="--vllm-python"):
        make_vllm_backend(_kwargs(tiny_models["llama"]), None)


def _gone(pid: int, within_s: float = 20.0) -> bool:
    """The process exited (no /proc entry, or a zombie no one reaped) within ``within_s``."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.05)
    return False


def _wait_for(path: Path, proc: subprocess.Popen | None = None, within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        assert proc is None or proc.poll() is None, proc.communicate()
        time.sleep(0.05)


def test_a_run_returns_once_the_vllm_processes_are_idle(
        stand_in: str, tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's worker spins on a core for a second after each message; the backend timed next
    must not share the machine with it, and the run reports what other processes used."""
    monkeypatch.setenv("STAND_IN_SPIN_S", "1.0")
    kw = _kwargs(tiny_models["llama"])
    spec, reqs, _ = build_workload(kw, dict(num_prompts=3, prompt_median=8, output_median=6))
    b = make_vllm_backend(kw, stand_in)
    try:
        res = b.run(reqs)
        after = group_cpu_s(b.proc.pid)
        time.sleep(0.5)
        assert group_cpu_s(b.proc.pid) - after <= 0.1 * 0.5
        assert 0.8 <= res.stats["idle_wait_s"] < 5
        assert res.stats["machine_cpu_s"] >= 0 and res.stats["cpu_s"] >= 0
    finally:
        b.close()
    assert wait_until_idle(b.proc.pid) < 1  # a group that is gone (or idle) is not waited for


def test_close_kills_the_engine_processes(stand_in: str, tmp_path: Path,
                                         tiny_models: dict[str, Path],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that exits cleanly skips vLLM's teardown; its engine child must not outlive it."""
    pids = tmp_path / "pids"
    monkeypatch.setenv("STAND_IN_PIDS", str(pids))
    kw = _kwargs(tiny_models["llama"])
    spec, reqs, _ = build_workload(kw, dict(num_prompts=3, prompt_median=8, output_median=6))
    res = run_throughput(reqs, spec, kw, ["vllm"], reps=1, warmup=0, vllm_python=stand_in)
    assert res["results"][0]["output_tokens"] == sum(r.max_tokens for r in reqs)
    worker, core = map(int, pids.read_text().split())
    assert _gone(worker) and _gone(core)


# Ctrl-C at a terminal is KeyboardInterrupt; a runner that starts us in the background (no job
# control) hands SIGINT down ignored, and Python then keeps it ignored, so restore the handler.
BENCH = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
from pagedllm.bench.throughput import run_throughput
from pagedllm.bench.workload import build_workload
kw = dict(model=sys.argv[1], max_model_len=64, block_size=4)
spec, reqs, _ = build_workload(kw, dict(num_prompts=3, prompt_median=8, output_median=6))
run_throughput(reqs, spec, kw, ["vllm"], reps=1, warmup=0, vllm_python=sys.executable)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_interrupted_or_killed_benchmark_leaves_no_vllm_process(
        sig: signal.Signals, stand_in: str, tmp_path: Path, tiny_models: dict[str, Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C (SIGINT: the backend's close kills the busy worker's group) or a killed benchmark
    (SIGKILL: the worker's parent-death signal, then it kills its own group) mid-run: neither
    the worker nor its engine child is left."""
    pids, started = tmp_path / "pids", tmp_path / "started"
    monkeypatch.setenv("STAND_IN_PIDS", str(pids))
    monkeypatch.setenv("STAND_IN_BLOCK", str(started))
    bench = subprocess.Popen([sys.executable, "-c", BENCH, str(tiny_models["llama"])],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(started, bench)
        worker, core = map(int, pids.read_text().split())
        bench.send_signal(sig)
        _, err = bench.communicate(timeout=60)
        assert bench.returncode != 0
        if sig == signal.SIGINT:
            assert "KeyboardInterrupt" in err
        assert _gone(worker), f"worker {worker} still runs"
        assert _gone(core), f"engine child {core} still runs"
    finally:  # nothing of this test outlives it, whatever it asserted
        bench.kill()
        bench.wait()
        for pid in map(int, pids.read_text().split() if pids.exists() else []):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_cpu_bind_lists_the_first_cpus_as_ranges() -> None:
    assert cpu_bind(2, [0, 1, 2, 3]) == "0-1"
    assert cpu_bind(4, [5, 0, 1, 7, 3]) == "0-1,3,5"
    assert cpu_bind(1, [4, 6]) == "4"


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PAGEDLLM_VLLM_PYTHON"),
                    reason="no vLLM Python: set PAGEDLLM_VLLM_PYTHON to a venv's python with "
                    "vllm installed (README 'Performance')")
def test_real_vllm_matches_pagedllm_greedy(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    assert main(["bench", "throughput", "--backends", "pagedllm,vllm", "--model",
                 str(tiny_models["llama"]), "--dtype", "float32", "--max-model-len", "128",
                 "--num-prompts", "6", "--prompt-median", "12", "--output-median", "10",
                 "--reps", "1", "--warmup", "2", "--kv-cache-memory", "1GiB",
                 "--output-dir", str(tmp_path), "--output-json", str(out), "--no-plot"]) == 0
    res = json.loads(out.read_text())
    row = {r["backend"]: r for r in res["results"]}["vllm"]
    assert row["vllm_version"] and row["output_tokens"] == res["workload"]["output_tokens"]
    assert row["cpu_s"] > 0  # the worker and vLLM's engine core, read from /proc
    assert res["greedy_output_agreement"]["pagedllm/vllm"] == 1.0
