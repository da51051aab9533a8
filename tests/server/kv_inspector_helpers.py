"""A served engine whose KV pool shows every block state while requests run: a pool too small for
the batch (preempted requests swap to the host tier), prompts that share a prefix (shared blocks,
prefix hits), n=2 (forked blocks), and finished or swapped-out requests' cached blocks; and a
way to hold the engine between two steps in a chosen state."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from server_helpers import API_KEY, ServerThread

from pagedllm.engine.snapshot import kv_snapshot

# 12 words = 12 tokens = 3 blocks of 4 (no word starts with a special token's text, t0..t3)
SYSTEM = " ".join(f"t{i}" for i in range(50, 62))


def inspector_app(model: Path, *, show_text: bool = False, trace: Path | None = None,
                  num_kv_blocks: int = 256, max_model_len: int = 256) -> Any:
    from pagedllm.engine import LLMEngine
    from pagedllm.server.api import build_app

    engine = LLMEngine.from_args(
        model=str(model), block_size=4, num_kv_blocks=num_kv_blocks, max_model_len=max_model_len,
        max_num_seqs=16, preemption_mode="swap", swap_space=0.004, reserved_fraction=0.0,
        kv_trace_path=None if trace is None else str(trace))
    return build_app(engine, model_name="tiny", api_key=API_KEY, kv_inspector=True,
                     kv_inspector_show_text=show_text)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def complete(server: ServerThread, prompt: str, max_tokens: int, n: int = 1,
             priority: int = 0) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "n": n,
            "temperature": 1.0, "seed": 1, "ignore_eos": True, "priority": priority}
    r = httpx.post(server.base_url + "/v1/completions", json=body, headers=auth(), timeout=120)
    assert r.status_code == 200, r.text


@contextmanager
def traffic(server: ServerThread, num: int = 12, max_tokens: int = 150,
            urgent_tokens: int = 200) -> Iterator[None]:
    """After one finished request (its blocks stay cached), ``num`` concurrent requests sharing
    a system prompt: the first two urgent (priority 0) with n=2, so their shared prompt blocks
    stay on the device (``urgent_tokens`` each), the rest less urgent (priority 1,
    ``max_tokens``), preempted to the host tier when the pool runs short; joined on exit."""
    complete(server, "t40 t41 t42 t43 t44 t45 t46 t47 t48", 4)
    threads = [threading.Thread(target=complete, args=(
        server, f"{SYSTEM} t{70 + i} t{80 + i} t{90 + i}", urgent_tokens if i < 2 else max_tokens,
        2 if i < 2 else 1, 0 if i < 2 else 1)) for i in range(num)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        for t in threads:
            t.join(180)


@contextmanager
def paused(server: ServerThread, want: Any) -> Iterator[dict[str, Any]]:
    """Hold the engine thread between two steps once ``want(engine)`` is true; yields
    {"snapshot": the inspector's capture then, "kv_stats": engine.kv_stats() then, "pool": the
    pool's block counts then}."""
    box: dict[str, Any] = {}
    ready, release = threading.Event(), threading.Event()
    inspector = server.app.state.kv_inspector

    def hold(engine: Any) -> bool:
        if not want(engine):
            return False
        engine.check_integrity()
        box["snapshot"] = snap = kv_snapshot(engine, inspector.show_text)
        # The page shows the inspector's latest snapshot; the core is held here, so hand it this
        # one (on the event loop, after any capture the core answered before the hold) and ask
        # for no other until the release.
        asyncio.run_coroutine_threadsafe(_publish(inspector, snap), inspector.client._loop).result(30)
        box["kv_stats"] = engine.kv_stats()
        pool = engine.kv.pool  # the pool's own counts, beside kv_stats()'s
        box["pool"] = {"num_blocks": pool.num_blocks, "free_blocks": pool.num_free_blocks,
                       "cached_blocks": pool.num_cached_free_blocks,
                       "used_blocks": pool.num_used_blocks, "shared_blocks": pool.num_shared_blocks,
                       "lora_blocks": engine.kv.adapters.num_blocks,
                       "host_used_blocks": engine.kv.num_host_blocks - engine.kv.num_free_host_blocks}
        ready.set()
        release.wait(60)
        return True

    holder: list[threading.Thread] = []

    def poll() -> None:
        while not server.call(hold):
            pass

    holder.append(threading.Thread(target=poll, daemon=True))
    holder[0].start()
    try:
        assert ready.wait(60), "the engine never reached the wanted state"
        yield box
    finally:
        inspector.__dict__.pop("refresh", None)  # captures resume
        release.set()
        holder[0].join(60)


async def _publish(inspector: Any, snap: dict[str, Any]) -> None:
    inspector.refresh = lambda: None
    pending = inspector._pending
    if pending is not None and not pending.done():  # answered before the hold: lands now
        await asyncio.wait({pending}, timeout=2)  # (asked after it: blocked until the release)
    inspector.num_captures += 1
    snap["seq"] = inspector.num_captures
    inspector.latest = snap


@contextmanager
def slowed(server: ServerThread, pause_s: float = 0.01) -> Iterator[None]:
    """Rest the engine thread ``pause_s`` between steps, so that the tiny model's run lasts long
    enough for a page that updates a few times a second to follow it."""
    stop = threading.Event()

    def rest() -> None:
        while not stop.is_set():
            server.call(lambda e: stop.wait(pause_s))

    t = threading.Thread(target=rest, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(30)
