"""``pagedllm serve`` as a real subprocess on a free loopback port, for end-to-end tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serve_process(*args: str, timeout: float = 90) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """Start ``python -m pagedllm.entrypoints.cli serve ARGS --port P``; yield (process, base URL) once
    ``/health`` answers 200; kill the process on exit if it is still running."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PAGEDLLM_LOG_LEVEL": "WARNING"}
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *args, "--port", str(port)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "pagedllm serve did not come up"
            time.sleep(0.2)
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
