"""The real command line, run as a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pagedllm import LLM, SamplingParams


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_help_lists_subcommands() -> None:
    r = _cli("--help")
    assert r.returncode == 0
    assert "generate" in r.stdout and "plan" in r.stdout


def test_python_m_pagedllm_and_the_console_script_are_the_same_command() -> None:
    from importlib.metadata import entry_points

    from pagedllm.entrypoints.cli import main

    (script,) = entry_points(group="console_scripts", name="pagedllm")
    assert script.load() is main
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    r = subprocess.run([sys.executable, "-m", "pagedllm", "plan", "--num-kv-blocks", "64"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout == _cli("plan", "--num-kv-blocks", "64").stdout and "64 blocks" in r.stdout
    assert subprocess.run([sys.executable, "-m", "pagedllm", "--help"], capture_output=True,
                          text=True, env=env, timeout=300).stdout.startswith("usage: pagedllm ")


def test_generate_streams_the_greedy_continuation(tiny_models: dict[str, Path]) -> None:
    model = str(tiny_models["llama"])
    r = _cli("generate", "t5 t6 t7", "--model", model, "--max-tokens", "6", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    expected = LLM(model=model).generate(
        "t5 t6 t7", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False
    )[0].outputs[0].text
    assert r.stdout == "t5 t6 t7" + expected + "\n"
    assert "6 tokens" in r.stderr and "finish_reason=length" in r.stderr


def test_bad_flags_give_a_clear_error(tiny_models: dict[str, Path]) -> None:
    r = _cli("generate", "t5", "--model", str(tiny_models["llama"]), "--block-size", "3")
    assert r.returncode == 2 and "block_size=3 must be a power of two" in r.stderr
    r = _cli("plan", "--model", str(tiny_models["llama"]), "--num-kv-blocks", "2", "--max-model-len", "512")
    assert r.returncode == 2 and "lower --max-model-len" in r.stderr


def test_device_flags(tiny_models: dict[str, Path]) -> None:
    model = str(tiny_models["llama"])
    r = _cli("plan", "--model", model, "--device", "cuda")
    assert r.returncode == 0, r.stderr
    assert "--gpu-memory-utilization=0.9 and a memory profile" in r.stdout
    r = _cli("plan", "--model", model, "--device", "tpu")
    assert r.returncode == 2 and "device='tpu' must be 'cpu', 'cuda' or 'cuda:N'" in r.stderr
    r = _cli("generate", "t5", "--model", model, "--gpu-memory-utilization", "0")
    assert r.returncode == 2 and "gpu_memory_utilization=0.0 must be in (0, 1]" in r.stderr
