"""guidellm, unchanged, against ``pagedllm serve`` (issue 33): its streaming sweep (synchronous,
then throughput, then a constant rate between them) on the shipped model completes every
request of every benchmark, none errored or incomplete, with TTFT, ITL and output token counts
in its JSON report.

guidellm pulls its own torch, transformers and datasets, so it lives in a venv of its own:
``PAGEDLLM_GUIDELLM`` names its ``guidellm`` executable (``.ci/run`` makes one: ``pip install
torch==2.13.0 guidellm``), else one on PATH is used; without either the test skips and says so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from serve_process import serve_process

import pagedllm

MODEL = Path(pagedllm.__file__).parent / "assets" / "default_model"
NUM_REQUESTS = 16
PROMPT_TOKENS, OUTPUT_TOKENS = 64, 32


def _guidellm() -> str:
    exe = os.environ.get("PAGEDLLM_GUIDELLM") or shutil.which("guidellm")
    if not exe:
        pytest.skip("guidellm is not installed: set PAGEDLLM_GUIDELLM to its executable "
                    "(python -m venv V && V/bin/pip install torch==2.13.0 guidellm)")
    return exe


@pytest.mark.slow  # a server, and guidellm's three benchmarks (~30 s)
def test_guidellm_streaming_benchmark_every_request_succeeds(tmp_path: Path) -> None:
    exe = _guidellm()
    report = tmp_path / "guidellm.json"
    with serve_process(str(MODEL), timeout=120) as (_, base):
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        run = subprocess.run(
            [exe, "run", "--backend", f"kind=openai_http,target={base}",
             "--profile", "kind=sweep,sweep_size=3",
             "--constraint", f"kind=max_requests,count={NUM_REQUESTS}",
             "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},"
                       f"output_tokens={OUTPUT_TOKENS}",
             "--tokenizer", f"kind=hf_auto,model={MODEL}",
             "--output", f"kind=json,path={report}", "--disable-console-interactive"],
            env={**env, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    benchmarks = json.loads(report.read_text())["benchmarks"]
    assert len(benchmarks) == 3
    for bench in benchmarks:
        _check(bench["metrics"])


def _check(m: dict[str, Any]) -> None:
    assert m["request_totals"] == {"successful": NUM_REQUESTS, "errored": 0, "incomplete": 0,
                                   "total": NUM_REQUESTS}, m["request_totals"]
    ttft = m["time_to_first_token_ms"]["successful"]
    assert ttft["count"] == NUM_REQUESTS and 0 < ttft["min"] <= ttft["mean"] <= ttft["max"]
    assert m["inter_token_latency_ms"]["successful"]["mean"] > 0
    out = m["output_token_count"]["successful"]
    assert out["min"] == out["max"] == OUTPUT_TOKENS  # every stream ran to its max_tokens
    assert m["request_streaming_iterations_count"]["successful"]["min"] > 1  # it streamed
