"""The live KV inspector (``pagedllm serve --kv-inspector``): a page at ``/kv``, its data at
``/kv/state`` (JSON) and ``/kv/stream`` (server-sent events, one message per snapshot).

Who does what, and why it is thread-safe::

    engine thread                         event loop (uvicorn)
    ─────────────                         ────────────────────
    capture(engine) between two steps ◀── fresh(): at most one capture per interval, shared by
      (queued as an AsyncEngine call)       every viewer, and only while someone is looking
                                          sampler task (2/s): one chart point from
                                            ``engine.stats``, the last step's StepStats record
                                          trace tail: new lines of the --kv-trace file

Only the engine thread reads the KV manager and the scheduler (``capture``); the event loop reads
the record the engine thread replaces whole after each step, and the trace file. Counts come from
the engine's own records (``kv_stats()`` / ``StepStats``), the block map from the manager's
public state (``pagedllm.kv.snapshot``). Prompt and output text is left out unless
``--kv-inspector-show-text``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from pagedllm.engine import LLMEngine
from pagedllm.kv.page import page_html
from pagedllm.kv.snapshot import capture_kv
from pagedllm.request import RequestStatus
from pagedllm.server.async_engine import AsyncEngine

HISTORY_FIELDS = ("t", "step", "total", "used", "cached", "shared", "host_used", "running",
                  "waiting", "swapped", "preemptions", "hits", "queries")
MAX_EVENTS = 300  # allocation events kept for the page
MAX_TRACE_READ = 4 << 20  # bytes of new trace read per tick (the rest waits for the next)
TEXT_CHARS = 300
STREAM_LIFETIME_S = 3.0  # a stream ends after this and the page reconnects: a drain never waits long


class KVInspector:
    def __init__(self, async_engine: AsyncEngine, show_text: bool = False,
                 interval_s: float = 0.25, sample_s: float = 0.5, history_s: float = 600.0) -> None:
        self.async_engine = async_engine
        self.engine = async_engine.engine
        self.show_text = show_text
        self.interval_s = interval_s
        self.sample_s = sample_s
        self.latest: dict[str, Any] | None = None
        self.num_captures = 0
        self._asked_at = -1e9
        self._pending: concurrent.futures.Future[Any] | None = None  # the capture asked for
        self.history: deque[list[float]] = deque(maxlen=max(1, int(history_s / sample_s)))
        self.events: deque[tuple[int, dict[str, Any]]] = deque(maxlen=MAX_EVENTS)
        self.num_events = 0
        self._trace_path = self.engine.config.cache.kv_trace_path
        self._trace_pos = 0
        self._trace_rest = b""
        self._texts: dict[str, str] = {}  # request id -> prompt text (show_text only)
        self._task: asyncio.Task[None] | None = None

    # -- the engine thread ---------------------------------------------------------------------
    def capture(self, engine: LLMEngine) -> dict[str, Any]:
        """A snapshot of the KV cache and the requests now; becomes ``latest``. Engine thread
        only (between steps), or with the engine thread stopped."""
        sched, kv = engine.scheduler, engine.kv
        snap = capture_kv(kv)
        now = time.monotonic()
        requests = []
        for r in sorted(sched.requests.values(), key=lambda r: r.sort_key):
            rid = r.request_id
            state = ("running" if r.status == RequestStatus.RUNNING
                     else "swapped" if kv.is_swapped(rid) else "waiting")
            entry: dict[str, Any] = {
                "id": rid, "state": state, "priority": r.priority,
                "prompt_tokens": r.num_prompt_tokens, "output_tokens": r.num_output_tokens,
                "computed": r.num_computed_tokens, "preemptions": r.num_preemptions,
                "age_s": round(now - r.arrival_time, 3),
            }
            if self.show_text:
                entry["prompt"] = self._prompt_text(engine, rid, r.prompt_token_ids)
                entry["output"] = str(engine.tokenizer.decode(r.output_token_ids[-64:]))[-TEXT_CHARS:]
            requests.append(entry)
        if self.show_text:
            self._texts = {rid: t for rid, t in self._texts.items() if rid in sched.requests}
        snap.update(
            step=sched.num_steps, time=time.time(), requests=requests, kv_stats=engine.kv_stats(),
            num_running=sched.num_running, num_waiting=sched.num_waiting,
            num_swapped=sched.num_swapped,
        )
        self.num_captures += 1
        snap["seq"] = self.num_captures
        self.latest = snap
        return snap

    def _prompt_text(self, engine: LLMEngine, rid: str, ids: list[int]) -> str:
        text = self._texts.get(rid)
        if text is None:
            text = self._texts[rid] = str(engine.tokenizer.decode(ids[:TEXT_CHARS]))[:TEXT_CHARS]
        return text

    # -- the event loop -------------------------------------------------------------------------
    def refresh(self) -> None:
        """Ask the engine thread for a new snapshot if the latest is older than the interval;
        one request at a time, shared by every viewer. Does not wait for it."""
        if self._pending is not None and not self._pending.done():
            return
        if time.monotonic() - self._asked_at < self.interval_s:
            return
        self._asked_at = time.monotonic()
        self._pending = self.async_engine.call_soon(self.capture)

    async def fresh(self) -> dict[str, Any]:
        """A snapshot at most one interval old (waits for the capture if one is due)."""
        self.refresh()
        pending = self._pending
        if pending is not None and not pending.done():
            # wait without cancelling: a cancelled call would break the engine thread's reply
            await asyncio.wait({asyncio.wrap_future(pending)}, timeout=30)
        if pending is not None and pending.done() and pending.exception() is not None:
            raise RuntimeError("the KV snapshot failed") from pending.exception()
        if self.latest is None:
            raise RuntimeError("the engine thread gave no KV snapshot within 30 s")
        return self.latest

    def start(self) -> None:
        """Start sampling chart points (in the app's lifespan)."""
        if self._task is None:
            self._task = asyncio.ensure_future(self._sample_loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _sample_loop(self) -> None:
        while True:
            self.sample()
            self.read_trace()
            await asyncio.sleep(self.sample_s)

    def sample(self) -> None:
        """One chart point from the last step's record (replaced whole by the engine thread)."""
        s = self.engine.stats
        self.history.append([
            round(time.time(), 3), s.step, s.kv.total, s.kv.used, s.kv.cached, s.kv.shared,
            s.kv.host_used, s.num_running, s.num_waiting, s.num_swapped, s.num_preemptions,
            s.prefix_cache_hits, s.prefix_cache_queries,
        ])

    def read_trace(self) -> None:
        """Take the new whole lines of the --kv-trace file (written line by line)."""
        if self._trace_path is None:
            return
        try:
            with open(self._trace_path, "rb") as f:
                f.seek(self._trace_pos)
                chunk = f.read(MAX_TRACE_READ)
        except OSError:
            return
        self._trace_pos += len(chunk)
        data = self._trace_rest + chunk
        lines = data.split(b"\n")
        self._trace_rest = lines.pop()
        skipped = max(0, len(lines) - MAX_EVENTS)
        self.num_events += skipped
        for line in lines[skipped:]:
            if line.strip():
                self.num_events += 1
                self.events.append((self.num_events, json.loads(line)))

    def message(self, state: dict[str, Any], history_after: float = 0.0,
                events_after: int = 0) -> dict[str, Any]:
        """What the page gets: a snapshot, the chart points after ``history_after`` (a time) and
        the allocation events after ``events_after`` (a sequence number)."""
        return {
            "state": state,
            "history_fields": HISTORY_FIELDS,
            "history": [p for p in self.history if p[0] > history_after],
            "events": [[n, e] for n, e in self.events if n > events_after],
            "num_events": self.num_events,
            "trace": self._trace_path is not None,
            "show_text": self.show_text,
            "interval_s": self.interval_s,
        }

    async def stream(self, history_after: float, events_after: int) -> AsyncIterator[str]:
        """Server-sent events: a message per new snapshot, for ``STREAM_LIFETIME_S``."""
        end = time.monotonic() + STREAM_LIFETIME_S
        seq = -1
        while time.monotonic() < end and self.async_engine.is_running:
            self.refresh()
            state = self.latest
            if state is not None and state["seq"] != seq:
                seq = state["seq"]
                msg = self.message(state, history_after, events_after)
                if msg["history"]:
                    history_after = msg["history"][-1][0]
                if msg["events"]:
                    events_after = msg["events"][-1][0]
                yield f"data: {json.dumps(msg, separators=(',', ':'))}\n\n"
            await asyncio.sleep(self.interval_s / 2)
        yield ": the stream ends here; reconnect for more\n\n"  # an SSE comment


def add_routes(app: Any, inspector: KVInspector, auth: Any) -> None:
    """``/kv`` (the page: no data in it, so no key needed to load it; it asks for the key),
    ``/kv/state`` and ``/kv/stream`` (behind ``auth``, as the API)."""
    from fastapi import APIRouter, Depends
    from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

    from pagedllm.server.responses import _SSE_HEADERS

    @app.get("/kv", include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(page_html())

    router = APIRouter(prefix="/kv", dependencies=[Depends(auth)], include_in_schema=False)

    @router.get("/state")
    async def state() -> JSONResponse:
        return JSONResponse(inspector.message(await inspector.fresh()))

    @router.get("/stream")
    async def stream(history_after: float = 0.0, events_after: int = 0) -> StreamingResponse:
        return StreamingResponse(inspector.stream(history_after, events_after),
                                 media_type="text/event-stream", headers=_SSE_HEADERS)

    app.include_router(router)
