"""Joining Ray from a pagedllm process: the cluster ``RAY_ADDRESS`` names, else a local one.

``ray.init`` installs its own SIGINT/SIGTERM handlers (they end the process at once). pagedllm's
processes have their own: the API server drains on SIGTERM, and an engine core ignores both,
leaving shutdown to its front end. ``join_ray`` keeps the handlers the process had, so joining
Ray (for a KV tier, Ray replicas or Ray TP workers) changes neither.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any


def join_ray(**kwargs: Any) -> None:
    """``ray.init`` at ``RAY_ADDRESS`` (no dashboard) unless Ray is initialised already, with
    this process's SIGINT/SIGTERM handlers kept (main thread: where handlers can be set)."""
    import ray

    if ray.is_initialized():
        return
    main = threading.current_thread() is threading.main_thread()
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
    ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, **kwargs)
    for sig, handler in saved.items():
        if handler is not None and signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)
