"""``pagedllm serve`` as a real subprocess on a loopback port, for end-to-end tests."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pagedllm.bench.server_process import serve_subprocess

REPO = Path(__file__).resolve().parents[1]


@contextmanager
def serve_process(*args: str, timeout: float = 90) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """Start ``python -m pagedllm.entrypoints.cli serve ARGS`` on 127.0.0.1, port 0 (the server
    reports the port it bound: no free-port race); yield (process, base URL) once ``/health``
    answers 200; kill the process on exit if it is still running."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PAGEDLLM_LOG_LEVEL": "WARNING"}
    with serve_subprocess(list(args), timeout=timeout, env=env) as running:
        yield running


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # after "(comm)": state, ppid
        if ppid == pid:
            out.append(int(entry.name))
    return out


def pid_alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited
