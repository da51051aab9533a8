"""``pagedllm serve`` as a subprocess on 127.0.0.1 for benchmarks (``bench soak``) and the
end-to-end tests."""

from __future__ import annotations

import queue
import re
import shlex
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO


@contextmanager
def serve_subprocess(args: list[str], log: IO[str] | None = None, timeout: float = 120,
                     env: dict[str, str] | None = None) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``python -m pagedllm.entrypoints.cli serve ARGS`` on 127.0.0.1, port 0: the port is read
    from the server's "listening on" line (no free-port race). Yields (process, base URL) once
    ``/health`` answers 200; kills the process on exit if it still runs. The server's output is
    drained all its life, copied to ``log``."""
    import httpx

    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *args, "--host", "127.0.0.1",
           "--port", "0"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str | None] = queue.Queue()
    tail: deque[str] = deque(maxlen=200)  # for the error message

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line)
            if log is not None:
                log.write(line)
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()

    def failed(why: str) -> RuntimeError:
        return RuntimeError(f"pagedllm serve {why}; command: {shlex.join(cmd)}\n" + "".join(tail))

    try:
        deadline = time.monotonic() + timeout
        base = None
        while base is None:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise failed(f"did not report its port within {timeout:.0f} s") from None
            if line is None:
                raise failed(f"exited with {proc.wait()} at start-up")
            found = re.search(r"listening on (https?://\S+)", line)
            base = found.group(1) if found else None
        while True:  # bound at once, listening once the engine has started
            if proc.poll() is not None:
                raise failed(f"exited with {proc.returncode} at start-up")
            try:
                # a test's self-signed certificate (--ssl-certfile) is not checked here
                if httpx.get(base + "/health", timeout=1, verify=False).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise failed(f"did not come up within {timeout:.0f} s")
            time.sleep(0.2)
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def rss_mib(pid: int) -> float | None:
    """Resident memory of a process and its live descendants (``pagedllm serve`` runs its
    engine core in a child), summed; None when it is gone. Pages both map (shared libraries)
    count twice: an upper bound, steady from one sample to the next."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    total = None
    for p in procs:
        try:
            total = (total or 0.0) + p.memory_info().rss / 2**20
        except psutil.Error:  # exited meanwhile
            continue
    return total
