"""``pagedllm serve`` as a real subprocess on a loopback port, for end-to-end tests."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


@contextmanager
def serve_process(*args: str, timeout: float = 90) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """Start ``python -m pagedllm.entrypoints.cli serve ARGS --port 0``, read the port the server bound from
    its "listening on" line (no free-port race), yield (process, base URL) once ``/health``
    answers 200; kill the process on exit if it is still running."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PAGEDLLM_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *args, "--port", "0"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()
    output: list[str] = []

    def pump() -> None:  # keeps draining the pipe for the server's whole life
        assert proc.stdout is not None
        for line in proc.stdout:
            output.append(line)
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    try:
        deadline = time.monotonic() + timeout
        base = None
        while base is None:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError("pagedllm serve did not report its port:\n" + "".join(output)) from None
            assert line is not None, f"pagedllm serve exited ({proc.wait()}):\n" + "".join(output)
            found = re.search(r"listening on (http://\S+)", line)
            base = found.group(1) if found else None
        while True:  # bound at once, listening once the engine has started
            assert proc.poll() is None, "".join(output)
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "pagedllm serve did not come up:\n" + "".join(output)
            time.sleep(0.2)
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
