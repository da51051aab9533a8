"""``bench serve --backends``: the servers' command lines, and a real run against pagedllm."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.bench.serve_backends import ServerSettings, server_command


def test_both_servers_get_the_same_settings(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    s = ServerSettings(model="/m", dtype="bfloat16", max_model_len=512, max_num_seqs=64,
                       kv_cache_memory=3 * 2**30 + 1, threads=2, extra=("--block-size", "32"),
                       vllm_extra=("--enforce-eager",))
    ours, env = server_command("pagedllm", s, 9001)
    assert ours[1:5] == ["-m", "pagedllm.entrypoints.cli", "serve", "--model"]
    theirs, venv = server_command("vllm", s, 9002, str(fake))
    assert theirs[:3] == [str(fake), "-m", "vllm.entrypoints.openai.api_server"]
    for cmd, port in ((ours, "9001"), (theirs, "9002")):
        flags = dict(zip(cmd, cmd[1:]))
        assert flags["--model"] == "/m" and flags["--port"] == port
        assert flags["--dtype"] == "bfloat16" and flags["--max-model-len"] == "512"
        assert flags["--max-num-seqs"] == "64"
    assert ours[ours.index("--kv-cache-memory") + 1] == str(3 * 2**30 + 1)
    assert ours[-2:] == ["--block-size", "32"] and theirs[-1] == "--enforce-eager"
    assert env["OMP_NUM_THREADS"] == "2"
    if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        assert venv["VLLM_CPU_KVCACHE_SPACE"] == "4"  # whole GiB, rounded up
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        assert venv["VLLM_CPU_OMP_THREADS_BIND"].count(",") + 1 >= 1
        # without --threads each engine runs at its own default (vLLM's: every core but one)
        _, venv = server_command("vllm", dataclasses.replace(s, threads=None), 9003, str(fake))
        assert "VLLM_CPU_OMP_THREADS_BIND" not in venv


def test_unknown_backend_and_missing_vllm_are_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    s = ServerSettings(model="/m")
    with pytest.raises(ValueError, match="unknown serve backend 'sglang'"):
        server_command("sglang", s, 1)
    monkeypatch.delenv("PAGEDLLM_VLLM_PYTHON", raising=False)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ValueError, match="--vllm-python"):
        server_command("vllm", s, 1)


def test_bench_serve_starts_drives_and_stops_pagedllm(tmp_path: Path) -> None:
    out = tmp_path / "res.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pagedllm", "bench", "serve", "--backends", "pagedllm",
         "--rounds", "2", "--num-prompts", "6", "--server-kv-cache-memory", "64MiB",
         "--server-max-num-seqs", "8", "--output-json", str(out), "--no-plot"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    s = res["summary"]["pagedllm"]
    assert len(res["runs"]["pagedllm"]) == 2 and s["failed"] == 0
    assert s["output_throughput"] > 0 and s["output_throughput_ratio"] == 1.0
    assert all(r["completed"] == 6 for r in res["runs"]["pagedllm"])
    assert "round 2/2: pagedllm" in proc.stdout
